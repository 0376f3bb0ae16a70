"""The toy draft/target pair, trained offline in minutes of CPU (41 on a loaded machine): opt-in only.

Nothing trains it unless asked: `specq demo-models`, `specq bench` and scripts/demo use the catalogue's
Qwen2.5-Coder pair, and the tests tiny random pairs built in seconds. It stays for benchmarks/, whose
scripts reproduce the benchmark log's measurements made on it, and for its own tests (with
SPECQ_TEST_TOY_PAIR=1). `corpus` is separate from training: `specq bench` takes its held-out prompts.

Both models are small Llamas trained from scratch on the Python standard library's own sources, with a
byte-level BPE tokenizer trained on the same text. The result behaves like a model family trained on
the same data: the target costs its full size at inference (six wide layers against the draft's one
narrow layer), is slightly better than the draft (held-out loss), and agrees with it on most greedy
tokens. Both are briefly trained: their output is code-shaped, not good code.

- `corpus`: the training text and the held-out prompts;
- `training`: the tokenizer, the two models and how they are trained (function-preserving growth,
  online distillation);
- `build`: the cached, locked build (`build_demo_models`) and what it measures (acceptance rate, cost
  ratio, Leviathan et al.'s speedup bound).

Everything is deterministic for a given seed on a given machine (fixed thread count, seeded
generators, sorted files), and cached in specq's data directory under a versioned name.
"""

from specq.models.demo.build import (
    MARKER,
    VERSION,
    DemoModels,
    build_demo_models,
    decode_step_times,
    default_dir,
    greedy_agreement,
)
from specq.models.demo.corpus import HELDOUT_EVERY, corpus_files, heldout_prompts, read_source, split_files, stdlib_root
from specq.models.demo.training import (
    CHAT_TEMPLATE,
    DEFAULT_RECIPE,
    EOT,
    Recipe,
    Shape,
    Trainer,
    encode_documents,
    grow_model,
    heldout_loss,
    make_model,
    param_count,
    train_models,
    train_tokenizer,
)

__all__ = [
    "CHAT_TEMPLATE",
    "DEFAULT_RECIPE",
    "EOT",
    "HELDOUT_EVERY",
    "MARKER",
    "VERSION",
    "DemoModels",
    "Recipe",
    "Shape",
    "Trainer",
    "build_demo_models",
    "corpus_files",
    "decode_step_times",
    "default_dir",
    "encode_documents",
    "greedy_agreement",
    "grow_model",
    "heldout_loss",
    "heldout_prompts",
    "make_model",
    "param_count",
    "read_source",
    "split_files",
    "stdlib_root",
    "train_models",
    "train_tokenizer",
]
