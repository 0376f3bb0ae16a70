"""The demo pair, built once and cached: `build_demo_models` finds a finished build of this version,
seed and recipe in specq's data directory, or builds one (under a lock, in a temporary folder renamed
into place) and measures it.

The build measures what speculative decoding needs (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding"):

- acceptance rate `a`: teacher-forced greedy agreement, i.e. over the target's own 64-token greedy
  continuations of held-out prompts, the fraction of positions where the draft's argmax equals the
  target's token;
- cost ratio `c`: the mean time of one single-token decode forward with a KV cache at batch 1, draft
  over target;
- the expected speedup bound of their Eq. 1 / Theorem 3.8, (1 - a^(K+1)) / ((1 - a)(K c + 1))
  (`decoding.stats.leviathan_bound`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specq.decoding.stats import leviathan_bound
from specq.errors import SpecqError
from specq.models.demo.corpus import HELDOUT_EVERY, corpus_files, heldout_prompts, read_source, split_files, stdlib_root
from specq.models.demo.training import (
    DEFAULT_RECIPE,
    Recipe,
    encode_documents,
    heldout_loss,
    param_count,
    train_models,
    train_tokenizer,
)
from specq.paths import data_dir, file_lock

if TYPE_CHECKING:
    import torch
    from transformers import LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

# Bump when anything that changes the built files changes; old builds stay where they are, unused.
VERSION = 3

MARKER = "build.json"  # written last: a folder without it is not a build


@dataclass
class DemoModels:
    """Where the built pair lives, and what the build measured."""

    target_dir: Path
    draft_dir: Path
    report: dict[str, Any] = field(default_factory=dict)


# --- measuring --------------------------------------------------------------------------------------


def greedy_agreement(
    target: LlamaForCausalLM,
    draft: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    prompts: list[str],
    new_tokens: int = 64,
) -> tuple[float, int]:
    """Teacher-forced greedy acceptance: over the target's greedy continuations of `prompts`, the
    fraction of positions where the draft's argmax, given the same prefix, is the target's token;
    returns (fraction, positions)."""
    import torch

    agreed = total = 0
    with torch.no_grad():
        for prompt in prompts:
            prompt_ids = torch.tensor([tokenizer(prompt)["input_ids"]])  # [1, prompt]
            sequence = target.generate(
                prompt_ids,
                attention_mask=torch.ones_like(prompt_ids),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )  # [1, prompt + new]
            generated = sequence[0, prompt_ids.shape[1] :]  # [new]
            draft_logits = draft(sequence).logits[0, prompt_ids.shape[1] - 1 : -1]  # [new, vocab]
            agreed += int((draft_logits.argmax(dim=-1) == generated).sum())
            total += len(generated)
    return agreed / max(1, total), total


def decode_step_times(
    models: dict[str, PreTrainedModel], context: torch.Tensor, steps: int = 48, rounds: int = 4
) -> dict[str, list[float]]:
    """Seconds of each single-token forward with a KV cache at batch 1 after `context`, per model.

    The models are timed in alternating rounds so that load from other processes hits them alike.
    """
    import torch

    def prefill(model: PreTrainedModel) -> tuple[Any, torch.Tensor]:
        out = model(context, use_cache=True)
        return out.cache, out.logits[:, -1:].argmax(dim=-1)  # [1, 1]

    times: dict[str, list[float]] = {name: [] for name in models}
    with torch.no_grad():
        for _ in range(rounds):
            for name, model in models.items():
                cache, token = prefill(model)
                for i in range(steps + 2):
                    begin = time.perf_counter()
                    out = model(token, cache=cache, use_cache=True)
                    elapsed = time.perf_counter() - begin
                    cache, token = out.cache, out.logits[:, -1:].argmax(dim=-1)  # [1, 1]
                    if i >= 2:  # the first steps warm allocator caches
                        times[name].append(elapsed)
    return times


# --- the build --------------------------------------------------------------------------------------


def default_dir(seed: int = 0) -> Path:
    return data_dir() / "demo-models" / f"v{VERSION}-seed{seed}"


def _read_complete(path: Path, seed: int, recipe: Recipe) -> dict[str, Any] | None:
    """The report of a finished build of this seed and recipe at `path`, or None if there is none."""
    try:
        report = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if (
        not isinstance(report, dict)
        or report.get("version") != VERSION
        or report.get("seed") != seed
        or report.get("recipe") != json.loads(json.dumps(asdict(recipe)))
        or not (path / "target").is_dir()
        or not (path / "draft").is_dir()
    ):
        return None
    return report


@contextlib.contextmanager
def _torch_threads(count: int) -> Iterator[None]:
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _build_threads() -> int:
    # A fixed count per machine keeps the weights reproducible; beyond 8 these small matmuls gain little.
    return max(1, min(8, os.cpu_count() or 1))


def build_demo_models(
    out_dir: Path | None = None, *, seed: int = 0, force: bool = False, recipe: Recipe = DEFAULT_RECIPE
) -> DemoModels:
    """Build (or find, already built) the demo pair under `out_dir`, by default in specq's data dir.

    The folder holds `target/` and `draft/` (each a `from_pretrained` folder with the tokenizer) and
    `build.json`, written last, with the report. A build happens in a temporary sibling folder renamed
    into place at the end, under an fcntl lock, so concurrent builders wait for one another and a
    killed build leaves nothing that looks complete.
    """
    final = Path(out_dir) if out_dir is not None else default_dir(seed)
    report = None if force else _read_complete(final, seed, recipe)
    if report is not None:
        return DemoModels(final / "target", final / "draft", report)
    final.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(final.parent / f".{final.name}.lock", logger.warning):  # a second builder says whom it waits on
        # Another process may have finished the same build while this one waited for the lock.
        report = None if force else _read_complete(final, seed, recipe)
        if report is not None:
            return DemoModels(final / "target", final / "draft", report)
        for stale in final.parent.glob(f".{final.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a killed build; the lock says none runs
        work = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            report = _build_into(work, seed, recipe)
            work.chmod(0o755)  # mkdtemp made it private; the finished folder is an ordinary one
            if final.exists():
                trash = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
                final.rename(trash / "old")
                shutil.rmtree(trash, ignore_errors=True)
            work.rename(final)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    logger.info("demo models ready in %s", final)
    return DemoModels(final / "target", final / "draft", report)


def _build_into(work: Path, seed: int, recipe: Recipe) -> dict[str, Any]:
    import torch

    started, cpu_started = time.perf_counter(), time.process_time()
    load_before = os.getloadavg()[0]
    threads = _build_threads()
    report: dict[str, Any] = {"version": VERSION, "seed": seed, "recipe": asdict(recipe), "threads": threads}
    with _torch_threads(threads):
        files = corpus_files()
        if len(files) < 10 * HELDOUT_EVERY:
            raise SpecqError(
                f"only {len(files)} Python source files under {stdlib_root()}; the demo models are trained "
                "on the standard library's sources, which this Python installation lacks"
            )
        train_files, heldout_files = split_files(files)
        train_files = train_files[: recipe.max_train_files]
        train_texts = [read_source(p) for p in train_files]
        logger.info("corpus: %s train files, %s held out", len(train_files), len(heldout_files))
        tokenizer = train_tokenizer(train_texts, recipe.vocab_size, recipe.max_positions)
        tokens = encode_documents(tokenizer, train_texts)
        report["corpus"] = {
            "train_files": len(train_files),
            "heldout_files": len(heldout_files),
            "train_chars": sum(map(len, train_texts)),
            "train_tokens": len(tokens),
        }
        report["tokenizer_seconds"] = round(time.perf_counter() - started, 1)
        logger.info("tokenizer: %s tokens, corpus of %s tokens", len(tokenizer), len(tokens))

        target, draft, stats = train_models(tokens, recipe, tokenizer.eos_token_id, seed)
        report["training"] = stats
        heldout_tokens = encode_documents(tokenizer, [read_source(p) for p in heldout_files])
        report["target_heldout_loss"] = round(heldout_loss(target, heldout_tokens, recipe.seq_len), 4)
        report["draft_heldout_loss"] = round(heldout_loss(draft, heldout_tokens, recipe.seq_len), 4)
        report["target_params"] = param_count(target)
        report["draft_params"] = param_count(draft)

        for name, model in (("target", target), ("draft", draft)):
            model.save_pretrained(work / name)
            tokenizer.save_pretrained(work / name)

        measure_started = time.perf_counter()
        prompts = heldout_prompts(recipe.eval_prompts, recipe.eval_prompt_chars)
        acceptance, positions = greedy_agreement(target, draft, tokenizer, prompts, recipe.eval_new_tokens)
        context = torch.tensor([tokenizer(prompts[0])["input_ids"]])  # [1, prompt]
        times = decode_step_times({"draft": draft, "target": target}, context)
        mean = {name: statistics.fmean(values) for name, values in times.items()}
        median = {name: statistics.median(values) for name, values in times.items()}
        cost_ratio = mean["draft"] / mean["target"]
        report.update(
            acceptance_rate=round(acceptance, 4),
            acceptance_positions=positions,
            t_target_ms=round(mean["target"] * 1e3, 3),
            t_draft_ms=round(mean["draft"] * 1e3, 3),
            cost_ratio=round(cost_ratio, 4),
            # Medians shrug off the moments other processes took the CPU; the means are the measure.
            t_target_median_ms=round(median["target"] * 1e3, 3),
            t_draft_median_ms=round(median["draft"] * 1e3, 3),
            speedup_bound_k4=round(leviathan_bound(acceptance, cost_ratio, 4), 3),
            measure_seconds=round(time.perf_counter() - measure_started, 1),
        )
    report["build_seconds"] = round(time.perf_counter() - started, 1)
    report["build_cpu_seconds"] = round(time.process_time() - cpu_started, 1)  # all threads together
    # Other processes share the CPU: the load average says how much the timings may be off.
    report["load_average"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    report["cpu_count"] = os.cpu_count()
    report["torch"] = torch.__version__
    logger.info(
        "built in %.0fs: acceptance %.3f, target %.2f ms, draft %.2f ms, c %.3f, speedup bound (K=4) %.2f",
        report["build_seconds"],
        acceptance,
        report["t_target_ms"],
        report["t_draft_ms"],
        cost_ratio,
        report["speedup_bound_k4"],
    )
    (work / MARKER).write_text(json.dumps(report, indent=2) + "\n")
    return report
