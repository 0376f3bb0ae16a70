"""The demo pair's tokenizer and its two small Llamas, trained from scratch on the corpus.

A few CPU minutes buy about a million training tokens, far too few for a model of the target's size;
so the data is learned by a model of the draft's size (cheap per token), which is then grown into the
target's shape without changing what it computes (Net2Net-style function-preserving growth, Chen et
al. 2016) and trained further at full size, while the draft, a copy of that small model, follows the
target's logits (online distillation). Everything is seeded: the same seed, corpus and thread count
give the same weights.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)
_LOG_EVERY_S = 10.0

EOT = "<|endoftext|>"

# Plain-text role markers: the demo models never saw chat data, so this only has to render and tokenize.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Shape:
    """One Llama's size."""

    layers: int
    hidden: int
    intermediate: int
    heads: int


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the built weights (besides the seed and the corpus) and the measuring."""

    vocab_size: int = 2048
    seq_len: int = 256  # longer than the prompts plus 64 new tokens used to measure, so no extrapolation
    batch_size: int = 8
    # Measured on 2 CPU cores: the target's batch-1 decode forward costs ~8 ms, the draft's ~1 ms.
    target: Shape = Shape(layers=6, hidden=384, intermediate=1024, heads=6)
    draft: Shape = Shape(layers=1, hidden=256, intermediate=688, heads=4)
    # Measured: 500 steps (~1M tokens) take ~80 s on 2 idle cores; the grown target's steps cost ~1.2 s
    # each and barely lower its loss, so they are few, with a learning rate that moves it visibly
    # away from the draft (2e-3 made it worse than where it started).
    pretrain_steps: int = 500  # the draft-sized model on the data
    grow_steps: int = 30  # the grown target on the data, the draft following its logits
    distill_steps: int = 0  # the draft alone on the finished target's logits
    pretrain_lr: float = 4e-3  # 2e-3 and 3e-3 did no better; 8e-3 did worse
    grow_lr: float = 1e-3
    follow_lr: float = 1e-3
    warmup_steps: int = 20
    draft_ce_weight: float = 0.0  # weight of the data's cross-entropy in the draft's loss, next to the KL
    max_positions: int = 1024
    max_train_files: int | None = None  # None: every training file; tests take a few
    eval_prompts: int = 12
    eval_new_tokens: int = 64
    eval_prompt_chars: int = 256


DEFAULT_RECIPE = Recipe()


# --- tokenizer --------------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int, max_length: int = 1024) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (exact round trip of any text) with EOT as BOS, EOS and pad.

    Plain prompts get BOS prepended, as in training, where every window starts with EOT.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    eot_id = backend.token_to_id(EOT)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B", special_tokens=[(EOT, eot_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=EOT,
        eos_token=EOT,
        pad_token=EOT,
        clean_up_tokenization_spaces=False,
        model_max_length=max_length,
        chat_template=CHAT_TEMPLATE,
    )


def encode_documents(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """One stream of token ids, each document followed by EOT; shape [tokens]."""
    import torch

    encodings = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    eot_id = tokenizer.eos_token_id
    ids: list[int] = []
    for encoding in encodings:
        ids.extend(encoding.ids)
        ids.append(eot_id)
    return torch.tensor(ids, dtype=torch.long)


# --- models and training ----------------------------------------------------------------------------


def make_model(shape: Shape, vocab_size: int, eot_id: int, max_positions: int) -> LlamaForCausalLM:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        max_position_embeddings=max_positions,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        # No pad_token_id in the config: Llama would make it the embedding's padding_idx, which freezes
        # that row, and EOT is also the BOS every sequence starts with. Generation gets it below.
        pad_token_id=None,
        # Tied embeddings: the vocabulary is a large share of these small models.
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.bos_token_id = eot_id
    model.generation_config.eos_token_id = eot_id
    model.generation_config.pad_token_id = eot_id
    return model


def param_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def grow_model(small: PreTrainedModel, big: PreTrainedModel) -> PreTrainedModel:
    """Make `big` compute exactly what `small` computes, in place, and return it.

    Function-preserving growth (Net2Net, Chen et al. 2016; bert2BERT, Chen et al. 2022), done with
    zeros: `small`'s weights fill the leading block of each of `big`'s matrices; everything that
    writes into the residual stream from a new hidden dimension, head, MLP unit or layer (rows or
    columns of `o_proj`/`down_proj`, new embedding columns) is zero, so the new parts add nothing
    until training moves them; what reads from them keeps its random init, so gradients reach them.
    RMSNorm divides by the root mean square over all hidden dimensions; the new ones are zero, so
    the norm weights are scaled by sqrt(small / big) to give back the same output. New layers sit
    between and after the old ones. Same head size, so attention scores and RoPE are unchanged.
    """
    import torch

    s_cfg, b_cfg = small.config, big.config
    s_hidden, b_hidden = s_cfg.hidden_size, b_cfg.hidden_size
    s_ffn = s_cfg.intermediate_size
    s_attn = s_cfg.num_attention_heads * (s_hidden // s_cfg.num_attention_heads)
    assert s_hidden // s_cfg.num_attention_heads == b_hidden // b_cfg.num_attention_heads, "head size differs"
    assert s_cfg.num_key_value_heads == s_cfg.num_attention_heads, "grouped-query attention not supported"
    assert b_cfg.num_key_value_heads == b_cfg.num_attention_heads, "grouped-query attention not supported"
    assert s_cfg.vocab_size == b_cfg.vocab_size and s_cfg.tie_word_embeddings and b_cfg.tie_word_embeddings
    assert b_hidden >= s_hidden and b_cfg.intermediate_size >= s_ffn
    assert b_cfg.num_hidden_layers >= s_cfg.num_hidden_layers
    norm_scale = (s_hidden / b_hidden) ** 0.5
    # small layer i becomes big layer positions[i]; the others are new
    positions = [i * b_cfg.num_hidden_layers // s_cfg.num_hidden_layers for i in range(s_cfg.num_hidden_layers)]

    def scaled_norm(b_norm: Any, s_norm: Any) -> None:  # LlamaRMSNorm, or None for a new layer
        b_norm.weight.fill_(norm_scale)
        if s_norm is not None:
            b_norm.weight[:s_hidden] = s_norm.weight * norm_scale

    with torch.no_grad():
        embed = big.model.embed_tokens.weight  # [vocab, big hidden]; the tied lm_head too
        embed.zero_()
        embed[:, :s_hidden] = small.model.embed_tokens.weight
        scaled_norm(big.model.norm, small.model.norm)
        for index, b_layer in enumerate(big.model.layers):
            s_layer = small.model.layers[positions.index(index)] if index in positions else None
            b_attn, b_mlp = b_layer.self_attn, b_layer.mlp
            scaled_norm(b_layer.input_layernorm, None if s_layer is None else s_layer.input_layernorm)
            scaled_norm(b_layer.post_attention_layernorm, None if s_layer is None else s_layer.post_attention_layernorm)
            b_attn.o_proj.weight.zero_()  # [big hidden, big heads * head size]
            b_mlp.down_proj.weight.zero_()  # [big hidden, big ffn]
            if s_layer is None:
                continue
            s_attn_mod, s_mlp = s_layer.self_attn, s_layer.mlp
            for name in ("q_proj", "k_proj", "v_proj"):  # [heads * head size, hidden]
                getattr(b_attn, name).weight[:s_attn, :s_hidden] = getattr(s_attn_mod, name).weight
            b_attn.o_proj.weight[:s_hidden, :s_attn] = s_attn_mod.o_proj.weight
            for name in ("gate_proj", "up_proj"):  # [ffn, hidden]
                getattr(b_mlp, name).weight[:s_ffn, :s_hidden] = getattr(s_mlp, name).weight
            b_mlp.down_proj.weight[:s_hidden, :s_ffn] = s_mlp.down_proj.weight
    return big


def _lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


class Trainer:
    """One model, its AdamW and its learning-rate schedule."""

    def __init__(self, model: PreTrainedModel, peak_lr: float, total_steps: int, warmup_steps: int):
        import torch

        self.model = model.train()
        self.peak_lr, self.total_steps, self.warmup_steps = peak_lr, total_steps, warmup_steps
        # No weight decay: a few hundred steps are far from overfitting.
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.step_index = 0

    def _update(self, loss: torch.Tensor) -> float:
        import torch

        for group in self.optimizer.param_groups:
            group["lr"] = _lr_at(self.step_index, self.total_steps, self.peak_lr, self.warmup_steps)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_index += 1
        return float(loss.detach())

    def lm_step(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, float]:
        """One step on the data's next tokens; returns the (detached) logits it computed and the loss."""
        logits = self.model(inputs).logits  # [batch, seq, vocab]
        loss = _cross_entropy(logits, labels)
        return logits.detach(), self._update(loss)

    def distill_step(
        self, inputs: torch.Tensor, labels: torch.Tensor, teacher_logits: torch.Tensor, ce_weight: float
    ) -> float:
        """One step towards the teacher's distributions (plus `ce_weight` times the data's loss)."""
        logits = self.model(inputs).logits  # [batch, seq, vocab]
        loss = _distill_loss(logits, teacher_logits)
        if ce_weight:
            loss = loss + ce_weight * _cross_entropy(logits, labels)
        return self._update(loss)


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) per position, averaged: the student learns the teacher's whole distribution."""
    import torch.nn.functional as F

    vocab = student_logits.shape[-1]
    student_logprobs = F.log_softmax(student_logits.reshape(-1, vocab), dim=-1)  # [batch * seq, vocab]
    teacher_logprobs = F.log_softmax(teacher_logits.reshape(-1, vocab), dim=-1)  # [batch * seq, vocab]
    return F.kl_div(student_logprobs, teacher_logprobs, log_target=True, reduction="batchmean")


def _batches(tokens: torch.Tensor, recipe: Recipe, eot_id: int, generator: torch.Generator) -> Iterator:
    """Endless random windows; each starts with EOT, as every prompt starts with BOS."""
    import torch

    span = recipe.seq_len - 1
    offsets = torch.arange(span)  # [span]
    while True:
        starts = torch.randint(0, len(tokens) - span, (recipe.batch_size,), generator=generator)  # [batch]
        windows = tokens[starts[:, None] + offsets]  # [batch, span]
        bos = torch.full((recipe.batch_size, 1), eot_id, dtype=torch.long)  # [batch, 1]
        batch = torch.cat([bos, windows], dim=1)  # [batch, seq_len]
        inputs = batch[:, :-1]  # [batch, seq_len - 1]
        labels = batch[:, 1:].clone()  # [batch, seq_len - 1]
        labels[:, 0] = -100  # what follows a random cut is noise, not a document start
        yield inputs, labels


def train_models(
    tokens: torch.Tensor, recipe: Recipe, eot_id: int, seed: int
) -> tuple[LlamaForCausalLM, LlamaForCausalLM, dict[str, Any]]:
    """Train the pair on `tokens`; returns (target, draft, stats).

    1. pretrain: the draft-sized model learns the data;
    2. grow: the target is that model grown into the target's shape (`grow_model`), then trained on
       the data, while the draft, a copy of the pretrained model, follows the target's logits on the
       same batches (online distillation, one cheap extra forward and backward a step);
    3. distill: optionally, the draft alone on the finished target's logits.
    Learning the data at the draft's size buys several times more tokens than the target's size
    would in the same minutes; the grown target still costs its full size at inference. The pair
    then resembles a model family trained on the same data, where the small member agrees with the
    large one on most tokens, which is what speculative decoding relies on.
    """
    import copy

    import torch

    torch.manual_seed(seed)
    core = make_model(recipe.draft, recipe.vocab_size, eot_id, recipe.max_positions)
    target = make_model(recipe.target, recipe.vocab_size, eot_id, recipe.max_positions)
    batches = _batches(tokens, recipe, eot_id, torch.Generator().manual_seed(seed))
    stats: dict[str, Any] = {}
    started = time.perf_counter()

    def run(
        stage: str,
        steps: int,
        learner: Trainer | None,
        follower: Trainer | None = None,
        teacher: PreTrainedModel | None = None,
    ) -> None:
        """`learner` learns the data; `follower` learns the logits of `learner` (or of a frozen `teacher`)."""
        loss = follow_loss = float("nan")
        stage_started = logged_at = time.perf_counter()
        for step in range(steps):
            inputs, labels = next(batches)
            if learner is not None:
                teacher_logits, loss = learner.lm_step(inputs, labels)  # [batch, seq, vocab]
            else:
                assert teacher is not None
                with torch.no_grad():
                    teacher_logits = teacher(inputs).logits  # [batch, seq, vocab]
            if follower is not None:
                follow_loss = follower.distill_step(inputs, labels, teacher_logits, recipe.draft_ce_weight)
            now = time.perf_counter()
            # a line at least every 10 s (a busy machine runs a step in seconds), each with the stage's ETA
            if step == 0 or step == steps - 1 or now - logged_at >= _LOG_EVERY_S:
                logged_at = now
                losses = {"loss": loss, "draft KL": follow_loss}
                shown = ", ".join(f"{name} {value:.3f}" for name, value in losses.items() if not math.isnan(value))
                left_s = (now - stage_started) / (step + 1) * (steps - step - 1)
                logger.info(
                    "%s step %s/%s: %s (%.0fs in; the stage ends in about %.0fs)",
                    stage,
                    step + 1,
                    steps,
                    shown,
                    now - started,
                    left_s,
                )
        # Only the numbers a stage has: NaN is not JSON.
        stats[stage] = {"steps": steps, "seconds": round(time.perf_counter() - started, 1)}
        if not math.isnan(loss):
            stats[stage]["loss"] = round(loss, 4)
        if not math.isnan(follow_loss):
            stats[stage]["draft_kl"] = round(follow_loss, 4)

    run(
        "pretrain",
        recipe.pretrain_steps,
        Trainer(core, recipe.pretrain_lr, recipe.pretrain_steps, recipe.warmup_steps),
    )
    draft = copy.deepcopy(core)
    grow_model(core.eval(), target)
    del core
    follow_steps = recipe.grow_steps + recipe.distill_steps
    follower = Trainer(draft, recipe.follow_lr, follow_steps, max(1, min(recipe.warmup_steps, follow_steps // 4)))
    learner = Trainer(
        target, recipe.grow_lr, recipe.grow_steps, max(1, min(recipe.warmup_steps, recipe.grow_steps // 4))
    )
    run("grow", recipe.grow_steps, learner, follower)
    target.eval()
    run("distill", recipe.distill_steps, None, follower, teacher=target)
    stats["train_tokens"] = (recipe.pretrain_steps + recipe.grow_steps) * recipe.batch_size * (recipe.seq_len - 1)
    return target, draft.eval(), stats


def heldout_loss(model: PreTrainedModel, tokens: torch.Tensor, seq_len: int, windows: int = 16) -> float:
    """Mean next-token cross-entropy (nats) over the first `windows` windows of `tokens`."""
    import torch

    usable = min(windows, len(tokens) // seq_len)
    batch = tokens[: usable * seq_len].reshape(usable, seq_len)  # [windows, seq_len]
    with torch.no_grad():
        logits = model(batch[:, :-1]).logits  # [windows, seq_len - 1, vocab]
    return float(_cross_entropy(logits, batch[:, 1:]))
