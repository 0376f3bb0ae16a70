"""Every model family, measured: tiny random models built from transformers' own config classes (no
download), decoded by the engine target-only and speculatively, at batch 1 and in ragged batches, must
give exactly `generate(do_sample=False)`'s tokens. Families with sliding-window or chunked attention
get a window shorter than prompt plus completion, and the test first shows that the window changes
transformers' own output (so a window ignored would fail here). Families that cannot be decoded
exactly are refused by name, from their config, at load, at `specq run` and at `specq submit`.

The table of families in docs/models.md is this matrix: `python -m tests.test_families` prints it, and
`test_the_models_page_lists_the_matrix` checks docs/models.md against it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from specq.decoding import DecodingConfig, GenerationRequest, SamplingParams, SpeculativeEngine
from specq.decoding.hf_model import attention_types
from specq.errors import ModelLoadError
from specq.models.families import RECURRENT_FAMILIES, attention_implementation, why_unsupported
from specq.models.loading import load_model
from tests.services import count_rows, invoke, services_env, write_requests
from tests.tiny_models import BOS, EOS, IdTokenizer, noisy_copy, reference_greedy

VOCAB = 128
NEW_TOKENS = 24
WINDOW = 8  # sliding window and attention chunk: far shorter than prompt plus completion
SHARPNESS = 8.0
MODELS_DOC = Path(__file__).resolve().parent.parent / "docs" / "models.md"
TABLE_BEGIN, TABLE_END = "<!-- families:begin -->", "<!-- families:end -->"

# Shared by every config: tiny, untied heads, ids 0 and 1 for BOS and EOS.
COMMON = {
    "vocab_size": VOCAB,
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "pad_token_id": BOS,
    "tie_word_embeddings": False,
}
LLAMA_LIKE = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


@dataclass(frozen=True)
class Family:
    """One row of the matrix: a config class and the keyword arguments that make it tiny."""

    name: str  # the config's model_type
    config_class: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    attention: str = "full"  # what docs/models.md says of its layers
    note: str = ""

    def config(self) -> Any:
        return getattr(transformers, self.config_class)(**{**COMMON, **self.kwargs})


SUPPORTED = [
    Family("llama", "LlamaConfig", LLAMA_LIKE),
    Family("mistral", "MistralConfig", {**LLAMA_LIKE, "sliding_window": WINDOW}, "sliding (every layer)"),
    Family(
        "qwen2",
        "Qwen2Config",
        {**LLAMA_LIKE, "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
        "full, then sliding",
    ),
    Family("qwen3", "Qwen3Config", {**LLAMA_LIKE, "head_dim": 8}),
    Family("gemma", "GemmaConfig", {**LLAMA_LIKE, "head_dim": 8}),
    Family(
        "gemma2",
        "Gemma2Config",
        {**LLAMA_LIKE, "head_dim": 8, "sliding_window": WINDOW},
        "sliding and full, alternating",
        "eager attention (logit soft-capping)",
    ),
    Family(
        "gemma3_text",
        "Gemma3TextConfig",
        {**LLAMA_LIKE, "head_dim": 8, "sliding_window": WINDOW, "sliding_window_pattern": 2},
        "sliding and full, alternating",
    ),
    Family("phi3", "Phi3Config", {**LLAMA_LIKE, "sliding_window": WINDOW}, "sliding (every layer)"),
    Family(
        "starcoder2",
        "Starcoder2Config",
        {**LLAMA_LIKE, "sliding_window": WINDOW, "residual_dropout": 0.0},
        "sliding (every layer)",
    ),
    Family("gpt2", "GPT2Config", {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 256}),
    Family(
        "gpt_neox",
        "GPTNeoXConfig",
        {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4},
    ),
    Family(
        "opt",
        "OPTConfig",
        {
            "hidden_size": 32,
            "ffn_dim": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "word_embed_proj_dim": 32,
            "max_position_embeddings": 256,
        },
    ),
    Family("falcon", "FalconConfig", {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}),
    Family("olmo2", "Olmo2Config", LLAMA_LIKE),
    Family(
        "mixtral",
        "MixtralConfig",
        {**LLAMA_LIKE, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW},
        "sliding (every layer)",
        "mixture of experts",
    ),
    Family(
        "cohere2",
        "Cohere2Config",
        {**LLAMA_LIKE, "sliding_window": WINDOW, "sliding_window_pattern": 2},
        "sliding and full, alternating",
    ),
    Family(
        "ministral",
        "MinistralConfig",
        {**LLAMA_LIKE, "head_dim": 8, "sliding_window": WINDOW},
        "sliding (every layer)",
    ),
    Family(
        "llama4_text",
        "Llama4TextConfig",
        {
            **LLAMA_LIKE,
            "head_dim": 8,
            "intermediate_size_mlp": 64,
            "num_local_experts": 2,
            "attention_chunk_size": WINDOW,
            "no_rope_layers": [1, 0],
            "interleave_moe_layer_step": 1,
        },
        "chunked, then full",
        "mixture of experts",
    ),
    Family(
        "gpt_oss",
        "GptOssConfig",
        {**LLAMA_LIKE, "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW},
        "sliding and full, alternating",
        "eager attention (attention sinks); mixture of experts",
    ),
    Family(
        "mpt",
        "MptConfig",
        {"d_model": 32, "n_heads": 4, "n_layers": 2, "max_seq_len": 256, "expansion_ratio": 2},
        "full (ALiBi)",
        "eager attention",
    ),
]

REFUSED = [
    Family("mamba", "MambaConfig", {"hidden_size": 32, "num_hidden_layers": 2, "state_size": 4}),
    Family(
        "jamba",
        "JambaConfig",
        {**LLAMA_LIKE, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "num_experts": 2},
    ),
    Family("qwen3_next", "Qwen3NextConfig", {**LLAMA_LIKE, "head_dim": 8}),
    Family("lfm2", "Lfm2Config", {**LLAMA_LIKE, "full_attn_idxs": [1]}),
    Family("falcon_h1", "FalconH1Config", LLAMA_LIKE),
    Family("granitemoehybrid", "GraniteMoeHybridConfig", {**LLAMA_LIKE, "mamba_n_heads": 4}),
    Family("bloom", "BloomConfig", {"hidden_size": 32, "n_layer": 2, "n_head": 4}),
]

WINDOWED = {"sliding": "sliding_window", "chunked": "attention_chunk_size"}


def build(family: Family, seed: int = 0) -> Any:
    """A tiny random model of `family` in eval mode, lm_head sharpened so greedy paths are stable."""
    torch.manual_seed(seed)
    config = family.config()
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention_implementation(config))
    model.eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(SHARPNESS)
    return model


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(2, VOCAB, (n,), generator=generator).tolist() for n in (13, 5, 21, 9)]


def windowed_kinds(model: Any) -> list[str]:
    return sorted({t for t in attention_types(model) if t != "full_attention"})


@contextlib.contextmanager
def window_off(model: Any) -> Iterator[None]:
    """transformers' own model with its sliding window or attention chunk made longer than any sequence."""
    config = model.config.get_text_config()
    saved = {name: getattr(config, name, None) for name in WINDOWED.values()}
    for name, value in saved.items():
        if value:
            setattr(config, name, 10_000)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(config, name, value)


def decode(target: Any, draft: Any, batch_size: int, k: int = 3, static_shapes: bool = False) -> dict[int, list[int]]:
    requests = [
        GenerationRequest(i, tuple(p), SamplingParams(max_tokens=NEW_TOKENS - 3 * (i % 2), temperature=0.0))
        for i, p in enumerate(prompts())
    ]
    config = DecodingConfig(
        num_speculative_tokens=k, batch_size=batch_size, fixed_k=True, strict=True, static_shapes=static_shapes
    )
    engine = SpeculativeEngine(target, IdTokenizer(), draft, config)
    return {r.key: r.token_ids for r in engine.generate(requests)}


def references(target: Any) -> dict[int, list[int]]:
    return {i: reference_greedy(target, p, NEW_TOKENS - 3 * (i % 2)) for i, p in enumerate(prompts())}


def generate(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """`generate(do_sample=False)`, not memoised, EOS excluded."""
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=EOS, pad_token_id=BOS
    )[0, len(prompt) :].tolist()
    return out[: out.index(EOS)] if EOS in out else out


@pytest.fixture(scope="module", params=SUPPORTED, ids=lambda f: f.name)
def family_models(request) -> tuple[Family, Any, Any]:
    family = request.param
    target = build(family)
    return family, target, noisy_copy(target, scale=0.01)


def test_target_only_and_speculative_greedy_equal_generate(family_models) -> None:
    family, target, draft = family_models
    expected = references(target)
    kinds = windowed_kinds(target)
    assert bool(kinds) == (family.attention.split()[0] != "full"), kinds
    if kinds:  # the window matters here: transformers' output without it differs
        with window_off(target):
            unwindowed = {i: generate(target, p, NEW_TOKENS - 3 * (i % 2)) for i, p in enumerate(prompts())}
        assert unwindowed != expected
    for batch_size in (1, 3):
        assert decode(target, None, batch_size) == expected, f"target only, batch {batch_size}"
        assert decode(target, draft, batch_size) == expected, f"speculative, batch {batch_size}"
    # the static-shape path (CUDA graphs'): attention over the whole capacity, each window still applied
    assert decode(target, draft, 3, static_shapes=True) == expected, "speculative, static shapes"


def test_a_draft_of_another_family() -> None:
    """A qwen2 target with sliding layers, a llama draft: only the vocabulary is shared."""
    target = build(SUPPORTED[2])
    draft = build(SUPPORTED[0], seed=5)
    assert decode(target, draft, batch_size=3, k=4) == references(target)


def test_eager_families_load_with_eager_and_the_rest_with_sdpa(tmp_path) -> None:
    for family in SUPPORTED:
        want = "eager" if "eager" in family.note else "sdpa"
        assert attention_implementation(family.config()) == want, family.name
    gemma2 = build(SUPPORTED[5])
    gemma2.save_pretrained(tmp_path / "gemma2")
    loaded = load_model(str(tmp_path / "gemma2"))
    assert loaded.config._attn_implementation == "eager"
    assert decode(loaded, None, batch_size=3) == references(gemma2)


@pytest.mark.parametrize("family", REFUSED, ids=lambda f: f.name)
def test_recurrent_and_alibi_families_are_refused_by_name(family, tmp_path) -> None:
    reason = why_unsupported(family.config())
    assert reason is not None and reason.startswith(f"{family.name} is not supported: ")
    assert "\n" not in reason
    family.config().save_pretrained(tmp_path)  # a config alone: refused before any weight is read
    with pytest.raises(ModelLoadError) as info:
        load_model(str(tmp_path))
    assert str(info.value) == f"the model {str(tmp_path)!r}: {reason}"


@pytest.fixture
def mamba_folder(tiny_pair, tmp_path) -> str:
    """The tiny pair's tokenizer beside a mamba config: a folder submit and run read before any weight."""
    import shutil

    folder = tmp_path / "mamba"
    shutil.copytree(tiny_pair[0], folder)
    (folder / "model.safetensors").unlink()
    REFUSED[0].config().save_pretrained(folder)
    return str(folder)


def test_run_refuses_an_unsupported_family_in_one_line(mamba_folder, tmp_path) -> None:
    path = write_requests(tmp_path / "in.jsonl", [{"id": "a", "prompt": "def", "max_tokens": 4}])
    result = invoke(["run", path, "-o", str(tmp_path / "out.jsonl"), "--target", mamba_folder])
    assert result.exit_code == 2, result.output
    assert f"Error: the model {mamba_folder!r}: mamba is not supported: " in result.stderr
    assert "Traceback" not in result.output


def test_submit_refuses_an_unsupported_family_and_stores_nothing(
    mamba_folder, tiny_pair, pg_db_url, redis_url, tmp_path
) -> None:
    from specq.db.models import Job, Request

    env = services_env(pg_db_url, redis_url, tmp_path / "home")
    path = write_requests(tmp_path / "in.jsonl", [{"id": "a", "prompt": "def", "max_tokens": 4}])
    for args in (["--target", mamba_folder], ["--target", tiny_pair[0], "--draft", mamba_folder]):
        result = invoke(["submit", path, *args], env)
        assert result.exit_code == 2, result.output
        assert f"the model {mamba_folder!r}: mamba is not supported: " in result.stderr
        assert result.stdout == "" and "Traceback" not in result.output
    assert count_rows(pg_db_url, Job) == 0 and count_rows(pg_db_url, Request) == 0


def test_every_stateful_causal_lm_of_transformers_is_refused() -> None:
    """`_is_stateful` is transformers' own mark for models whose state assisted generation cannot roll back."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    accepted = []
    for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        config = None
        with contextlib.suppress(Exception):  # code that needs a missing package, a config that will not build
            if getattr(transformers, class_name)._is_stateful or model_type in RECURRENT_FAMILIES:
                config = CONFIG_MAPPING[model_type]()
        if config is not None and why_unsupported(config) is None:
            accepted.append(model_type)
    assert accepted == []


def test_supported_families_pass(family_models) -> None:
    assert why_unsupported(family_models[0].config()) is None


# -- docs/models.md's table ------------------------------------------------------------------------------
def families_table() -> str:
    lines = ["| family | layers | status |", "| --- | --- | --- |"]
    for family in SUPPORTED:
        note = f"; {family.note}" if family.note else ""
        lines.append(f"| `{family.name}` | {family.attention} | identical to `generate`{note} |")
    for family in REFUSED:
        reason = why_unsupported(family.config()) or ""
        lines.append(f"| `{family.name}` | | refused: {reason.split(': ', 1)[1]} |")
    return "\n".join(lines)


def test_the_models_page_lists_the_matrix() -> None:
    text = MODELS_DOC.read_text(encoding="utf-8")
    if TABLE_BEGIN not in text:
        pytest.skip("docs/models.md has no families table yet (python -m tests.test_families prints it)")
    block = text.split(TABLE_BEGIN, 1)[1].split(TABLE_END, 1)[0].strip()
    assert block == families_table()


if __name__ == "__main__":
    sys.stdout.write(f"{TABLE_BEGIN}\n{families_table()}\n{TABLE_END}\n")
