"""A recurrent draft head over the target's own hidden state as the proposer (ReDrafter, Cheng et al.
2024; the feature-level drafting of EAGLE, Li et al. 2024, and Medusa's heads, Cai et al. 2024).

The head keeps no KV cache: its state starts as the target's final hidden state (what the target's
LM head reads) at the position that produced the row's newest token x1, and each draft token is one
small step of it:

    s_0 = the target's final hidden state that produced x1
    s_i = norm(s_{i-1} + down(silu(gate([s_{i-1}; e(x_i)])) * up([s_{i-1}; e(x_i)])))     i = 1..k
    x_{i+1} ~ softmax(W' s_i)

with e the target's input embedding and W' the target's own LM-head rows of a reduced vocabulary:
the V' tokens the target most often says (tokens outside it are never proposed). On SmolLM2-135M the
whole 49,152 x 576 head costs about a fifth of a target forward per draft token; 8,192 rows cost a
sixth of that. Both tables are the target's, frozen and shared with it, never stored with the head.

The target's final hidden states are read by a forward pre-hook on its LM head (`HiddenTap`, in
decoding/hf_model.py), installed on every target a load makes before it is compiled, so that a compiled
target's graphs return them too: the verify pass computes them anyway, so reading them costs nothing
(a reference to the LM head's input; on CUDA graphs a copy of [rows, k + 1, H] where a head reads it).
After each verify the row's new state is the hidden state at its last accepted position. A row's
first state is its prefill's at the prompt's last position (the one whose logits gave its first token),
which the prefill picks per group of rows as it picks those logits (`RaggedLM.prefill_rows`), so a row
drafts from its first step. Where the prefill gives none (a target that cannot return the last
position's logits alone, or rows sharing a prompt, prefilled once for all of them) the row's first step
verifies without drafting and the proposer takes the state from it.

Beside prompt lookup or the suffix index (`--draft HEAD_DIR --model-free ngram|suffix`) the head is the
model part of the hybrid (decoding/model_free.py), in a draft model's place: its steps are priced as a
draft model's forwards, it drafts only the rows the step's plan gives it, and rows that take a lookup
leave it nothing to roll back, as it keeps no cache along its drafts.

Lossless as any proposer: greedy rows accept what the target would have said, sampled rows are
verified by modified rejection sampling against the head's probabilities (decoding/rejection.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from specq.decoding.hf_model import HiddenTap
from specq.decoding.proposer import Offer
from specq.decoding.sampling import Stream, counter_uniforms, logits_to_probs, race_sample, sample_from_probs
from specq.decoding.stats import DRAFT_MODEL

if TYPE_CHECKING:
    from specq.decoding.batch import Admission, BatchState
    from specq.decoding.hf_model import CausalLM
    from specq.decoding.stats import EngineStats

HEAD_CONFIG = "specq-head.json"  # names a folder as a draft head (`--draft DIR` loads it beside the target)
HEAD_WEIGHTS = "head.pt"
HEAD_KIND = "recurrent-head"


@dataclass(frozen=True)
class HeadConfig:
    """What a head folder's HEAD_CONFIG holds: the head's shape and the target it was trained for."""

    hidden_size: int  # the target's
    intermediate_size: int
    vocab_rows: int  # V': the target's LM-head rows the head proposes from
    target_vocab_size: int  # the target's LM-head rows, to refuse a head made for another target
    kind: str = HEAD_KIND
    version: int = 1


def is_head_folder(path: str | Path) -> bool:
    """Whether `--draft PATH` names a draft head: the one rule `run`, `submit` and the workers apply
    (models/loading.py check_pair)."""
    return (Path(path) / HEAD_CONFIG).is_file()


# -- reading a head folder, every field checked before anything is built ---------------------------------
CONFIG_BYTES = 64 * 1024  # a head's config is ~150 bytes; a bigger file is not one, and is never read whole
# The weights' bytes per element: a head is saved in its target's dtype (fp32, bf16 or fp16), never
# narrower, and its vocabulary ids as int64.
FLOAT_BYTES = (2, 4)
ID_BYTES = 8
# torch.save's zip archive beyond the tensors' bytes: the pickle, the records' headers and their 64-byte
# alignment (2.3 KB for a head of five tensors); a file further off its config's size is another head's
ARCHIVE_SLACK = 1024 * 1024


def _int_field(raw: dict[str, Any], name: str, low: int, high: int | None = None) -> int:
    value = raw.get(name)
    if type(value) is not int:  # bool is an int to isinstance; a float or a string is no size either
        raise ValueError(f"{name} is {value!r}, not a whole number")
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} is {value}, not {bounds}")
    return value


def parse_head_config(raw: Any, hidden_size: int, vocab_size: int) -> HeadConfig:
    """The HeadConfig of a head's parsed JSON, for a target `hidden_size` wide with `vocab_size` LM-head
    rows; ValueError naming the first field that is missing, unknown, mistyped, out of range or made for
    another target."""
    if not isinstance(raw, dict):
        raise ValueError(f"it holds a JSON {type(raw).__name__}, not an object")
    unknown = sorted(set(raw) - {f.name for f in fields(HeadConfig)})
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r}")
    kind, version = raw.get("kind", HEAD_KIND), raw.get("version", 1)
    if kind != HEAD_KIND or type(version) is not int or version != 1:
        raise ValueError(f"it names a head of kind {kind!r} v{version!r}")
    config = HeadConfig(
        hidden_size=_int_field(raw, "hidden_size", 1),
        intermediate_size=_int_field(raw, "intermediate_size", 1),
        vocab_rows=_int_field(raw, "vocab_rows", 1),
        target_vocab_size=_int_field(raw, "target_vocab_size", 1),
    )
    if config.hidden_size != hidden_size or config.target_vocab_size != vocab_size:
        raise ValueError(
            f"the head was trained for a target {config.hidden_size} wide with {config.target_vocab_size} "
            f"tokens; this one is {hidden_size} wide with {vocab_size}"
        )
    if config.vocab_rows > vocab_size:
        raise ValueError(f"vocab_rows is {config.vocab_rows}, more than the target's {vocab_size} tokens")
    return config


def head_tensor_shapes(config: HeadConfig) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor a head's weight file holds (DraftHead's state dict)."""
    hidden, inner = config.hidden_size, config.intermediate_size
    return {
        "vocab_ids": (config.vocab_rows,),
        "gate.weight": (inner, 2 * hidden),
        "up.weight": (inner, 2 * hidden),
        "down.weight": (hidden, inner),
        "norm.weight": (hidden,),
    }


def check_weights_size(config: HeadConfig, size: int) -> None:
    """ValueError unless a weight file of `size` bytes can hold the tensors `config` implies: checked
    before the file is read, so that a config (or file) of another size never costs the memory it claims."""
    shapes = head_tensor_shapes(config)
    floats = sum(math.prod(shape) for name, shape in shapes.items() if name != "vocab_ids")
    ids = config.vocab_rows * ID_BYTES
    least, most = floats * FLOAT_BYTES[0] + ids, floats * FLOAT_BYTES[-1] + ids + ARCHIVE_SLACK
    if not least <= size <= most:
        raise ValueError(
            f"its config implies {least:,} to {most:,} bytes of weights, but {HEAD_WEIGHTS} holds {size:,}"
        )


def check_head_weights(config: HeadConfig, weights: Any) -> None:
    """ValueError unless `weights` (a loaded HEAD_WEIGHTS) holds exactly the tensors `config` implies:
    floating weights, all finite, and distinct vocabulary ids in [0, target_vocab_size)."""
    shapes = head_tensor_shapes(config)
    if not isinstance(weights, dict) or set(weights) != set(shapes):
        names = sorted(weights) if isinstance(weights, dict) else type(weights).__name__
        raise ValueError(f"{HEAD_WEIGHTS} holds {names}, not the tensors {sorted(shapes)}")
    for name, shape in shapes.items():
        tensor = weights[name]
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape:
            found = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"{name} is {found}, not {shape}")
        if name != "vocab_ids" and not (tensor.is_floating_point() and bool(torch.isfinite(tensor).all())):
            raise ValueError(f"{name} is not finite floating-point ({tensor.dtype})")
    vocab_ids = weights["vocab_ids"]
    if vocab_ids.is_floating_point() or vocab_ids.is_complex() or vocab_ids.dtype == torch.bool:
        raise ValueError(f"vocab_ids are {vocab_ids.dtype}, not token ids")
    low, high = int(vocab_ids.min()), int(vocab_ids.max())
    if low < 0 or high >= config.target_vocab_size:
        raise ValueError(f"vocab_ids span [{low}, {high}], outside the target's [0, {config.target_vocab_size})")
    if int(torch.unique(vocab_ids).numel()) != config.vocab_rows:
        raise ValueError("vocab_ids repeat a token")


def read_head(folder: str | Path, hidden_size: int, vocab_size: int) -> tuple[HeadConfig, dict[str, torch.Tensor]]:
    """The checked config and weights of the head in `folder`, for a target `hidden_size` wide with
    `vocab_size` LM-head rows; ValueError with one sentence where any field does not fit. What a load
    builds on (`load_head`) and what `submit` checks (models/loading.py check_pair), so both refuse alike."""
    folder = Path(folder)
    config_path, weights_path = folder / HEAD_CONFIG, folder / HEAD_WEIGHTS
    try:
        if config_path.stat().st_size > CONFIG_BYTES:
            raise ValueError(f"it is larger than {CONFIG_BYTES:,} bytes")
        config = parse_head_config(json.loads(config_path.read_text(encoding="utf-8")), hidden_size, vocab_size)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{config_path} is not a draft head's config ({_first_line(exc)})") from None
    try:
        check_weights_size(config, weights_path.stat().st_size)
        weights = torch.load(weights_path, map_location="cpu", weights_only=True)
        check_head_weights(config, weights)
    except Exception as exc:  # a truncated or foreign file fails in the unpickler, anyhow
        raise ValueError(f"cannot load the draft head in {folder} ({type(exc).__name__}: {_first_line(exc)})") from None
    return config, weights


class DraftHead(torch.nn.Module):
    """The recurrent head on a target. Its own parameters are the step's (gate, up, down, norm); the
    vocabulary it proposes from is a buffer of target ids; the embedding and LM-head rows are views of
    the target's, not saved with it."""

    vocab_ids: torch.Tensor  # [V'] the target ids of the head's rows (a buffer)

    def __init__(self, target: Any, config: HeadConfig, vocab_ids: torch.Tensor) -> None:  # a PreTrainedModel
        super().__init__()
        embedding = target.get_input_embeddings().weight  # [V, H]
        lm_head = target.get_output_embeddings().weight  # [V, H]
        hidden = embedding.shape[1]
        if config.hidden_size != hidden or config.target_vocab_size != lm_head.shape[0]:
            raise ValueError(
                f"the head was trained for a target {config.hidden_size} wide with {config.target_vocab_size} "
                f"tokens; this one is {hidden} wide with {lm_head.shape[0]}"
            )
        fits = vocab_ids.shape == (config.vocab_rows,) and vocab_ids.numel() > 0
        # a negative id would index the target's tables too, from their end
        if not fits or int(vocab_ids.min()) < 0 or int(vocab_ids.max()) >= lm_head.shape[0]:
            raise ValueError("the head's vocabulary does not fit its config or the target")
        self.config = config
        self.target_vocab_size = int(lm_head.shape[0])
        device, dtype = embedding.device, embedding.dtype
        self.register_buffer("vocab_ids", vocab_ids.to(device=device, dtype=torch.int64))  # [V']
        # the target's tables, read and never trained or saved
        self._embedding = embedding.detach()
        self._head_rows = lm_head.detach()[self.vocab_ids]  # [V', H], a copy of V' rows
        width = 2 * hidden
        self.gate = torch.nn.Linear(width, config.intermediate_size, bias=False, device=device, dtype=dtype)
        self.up = torch.nn.Linear(width, config.intermediate_size, bias=False, device=device, dtype=dtype)
        self.down = torch.nn.Linear(config.intermediate_size, hidden, bias=False, device=device, dtype=dtype)
        torch.nn.init.zeros_(self.down.weight)  # an untrained head keeps s_0: it proposes what x1's state said
        self.norm = torch.nn.RMSNorm(hidden, eps=1e-5, device=device, dtype=dtype)
        final_norm = _final_norm_weight(target)
        if final_norm is not None and final_norm.shape == (hidden,):
            with torch.no_grad():  # the scale the target's LM head reads its states at
                self.norm.weight.copy_(final_norm)

    def step(self, state: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """The next state [n, H] from `state` [n, H] and the token just proposed or emitted [n]."""
        joined = torch.cat([state, self._embedding[token_ids]], dim=-1)  # [n, 2H]
        return self.norm(state + self.down(torch.nn.functional.silu(self.gate(joined)) * self.up(joined)))

    def logits(self, state: torch.Tensor) -> torch.Tensor:
        """[n, V'] over the head's vocabulary (`vocab_ids`)."""
        return state @ self._head_rows.T

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        own = {name: value.detach().cpu() for name, value in self.state_dict().items()}
        torch.save(own, folder / HEAD_WEIGHTS)
        (folder / HEAD_CONFIG).write_text(json.dumps(asdict(self.config), indent=2) + "\n", encoding="utf-8")


def _final_norm_weight(target: CausalLM) -> torch.Tensor | None:
    base = getattr(target, getattr(target, "base_model_prefix", "model"), None)
    norm = getattr(base, "norm", None)
    weight = getattr(norm, "weight", None)
    return weight.detach() if isinstance(weight, torch.Tensor) else None


def load_head(folder: str | Path, target: CausalLM) -> DraftHead:
    """The head in `folder` on `target` (its device and dtype); ValueError with one sentence if the
    folder is not a head's or the head was made for another target (`read_head`: before anything is built)."""
    lm_head = target.get_output_embeddings().weight  # [V, H]
    config, weights = read_head(folder, int(lm_head.shape[1]), int(lm_head.shape[0]))
    try:
        head = DraftHead(target, config, weights["vocab_ids"])
        head.load_state_dict(weights)
    except Exception as exc:  # checked above; what is left is the target's own (a device out of memory)
        raise ValueError(f"cannot load the draft head in {folder} ({type(exc).__name__}: {_first_line(exc)})") from None
    return head.eval()


def _first_line(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else "no message"


class DraftHeadProposer:
    """Implements `Proposer` with a `DraftHead` reading the target's final hidden states."""

    def __init__(self, head: DraftHead, target: CausalLM, max_k: int, vocab_size: int) -> None:
        self.head = head
        self.max_k = max_k
        self.vocab_size = vocab_size  # draft_probs are padded to it, as the target's probabilities are
        self.tap = HiddenTap.on(target)
        hidden = head.config.hidden_size
        parameter = next(head.parameters())
        self.states = parameter.new_zeros(0, hidden)  # [rows, H] the state that produced each row's newest token
        self.ready = np.zeros(0, bool)  # [rows] whether `states` holds it
        self.prefilled = np.zeros(0, bool)  # [rows] admitted with the prefill's state, their first token not appended

    def admit(self, batch: BatchState, admission: Admission, stats: EngineStats) -> None:
        hidden = self.tap.take()  # [n, 1, H]: the prefill's at each prompt's last position, or None
        rows = admission.rows
        taken = hidden is not None and hidden.shape[0] == rows.size
        if taken:
            assert hidden is not None
            self.states[admission.rows_t.to(self.states.device)] = hidden[:, 0].to(self.states.dtype)
        self.ready[rows] = False
        self.prefilled[rows] = taken

    def offer(self, batch: BatchState, live: np.ndarray, limits: np.ndarray) -> Offer:
        lengths = np.zeros(batch.rows, np.int64)
        lengths[live] = np.where(self.ready[live], np.minimum(limits[live], self.max_k), 0)
        return Offer(lengths, np.full(batch.rows, DRAFT_MODEL, np.int64))

    def propose(
        self, batch: BatchState, k: int, num_draft_h: np.ndarray, stats: EngineStats
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        sampling = batch.sampling
        head = self.head
        state = self.states
        token = batch.token_ids.gather(1, (batch.seq_lens - 1).unsqueeze(1)).squeeze(1)  # [rows] x1
        token_ids: list[torch.Tensor] = []  # k of [rows]
        probs: list[torch.Tensor] = []  # k of [rows, V]
        for i in range(k):
            state = head.step(state, token)
            logits = head.logits(state)  # [rows, V']
            stats.draft_forwards += 1
            if sampling.all_greedy:
                token = head.vocab_ids[logits.argmax(dim=-1)]
                token_ids.append(token)
                continue
            full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))  # [rows, V]
            full.index_copy_(1, head.vocab_ids, logits)
            position_probs = logits_to_probs(full.unsqueeze(1), sampling).squeeze(1)  # [rows, V]
            positions = (batch.seq_lens + i).unsqueeze(1)  # [rows, 1]
            if sampling.reproducible:  # the target's noise at this position: the coupling
                token = race_sample(position_probs.unsqueeze(1), sampling.seeds, positions).squeeze(1)
            else:
                uniforms = counter_uniforms(sampling.seeds, positions, Stream.DRAFT)  # [rows, 1]
                token = sample_from_probs(position_probs, uniforms.squeeze(1))
            token_ids.append(token)
            probs.append(position_probs)
        draft_probs = torch.stack(probs, dim=1) if probs else None  # [rows, k, V]
        return torch.stack(token_ids, dim=1), draft_probs

    def forget_drafts(self, rows_t: torch.Tensor, seq_lens: torch.Tensor, seq_h: np.ndarray, rows: np.ndarray) -> None:
        """Rows that take another proposer's tokens this step (the hybrid: decoding/model_free.py): nothing
        to forget, as the head keeps no cache along its drafts and its next state is the verify's."""

    def advance(self, batch: BatchState, output_ids: np.ndarray, emitted: np.ndarray) -> None:
        hidden = self.tap.take()  # [rows, k + 1, H] of the verify, None after the prefill's first tokens
        rows = np.flatnonzero(emitted)
        if rows.size == 0:
            return
        if hidden is None or hidden.shape[0] != batch.rows:
            self.ready[rows] = self.prefilled[rows]  # a first token: from the state `admit` took, if any
            self.prefilled[rows] = False
            return
        self.prefilled[rows] = False
        rows_t = torch.from_numpy(rows).to(self.states.device)
        # the position that produced the row's newest token: after its accepted draft tokens
        at = torch.from_numpy(emitted[rows] - 1).to(self.states.device)
        self.states[rows_t] = hidden[rows_t, at].to(self.states.dtype)
        self.ready[rows] = True

    def release(self, rows: list[int], rows_t: torch.Tensor) -> None:
        self.ready[rows] = self.prefilled[rows] = False

    def resize(self, rows: int, capacity: int, keep: np.ndarray | None) -> None:
        kept_states = self.states if keep is None else self.states[torch.as_tensor(keep, device=self.states.device)]
        kept_ready = self.ready if keep is None else self.ready[keep]
        kept_prefilled = self.prefilled if keep is None else self.prefilled[keep]
        kept_states, kept_ready, kept_prefilled = kept_states[:rows], kept_ready[:rows], kept_prefilled[:rows]
        add = rows - kept_ready.size
        self.states = torch.cat([kept_states, kept_states.new_zeros(add, kept_states.shape[1])])
        self.ready = np.concatenate([kept_ready, np.zeros(add, bool)])
        self.prefilled = np.concatenate([kept_prefilled, np.zeros(add, bool)])
