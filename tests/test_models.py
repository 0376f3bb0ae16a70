"""The model loading layer (models/loading.py, on tiny_pair: built in seconds) and the toy pair's builder
(models/demo/: its stages on a recipe that trains in about a second; the built pair itself only where
SPECQ_TEST_TOY_PAIR=1, see conftest's `demo_pair`)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from specq.decoding.stats import leviathan_bound
from specq.errors import ModelLoadError
from specq.models import demo
from specq.models.loading import load_model, load_pair, load_tokenizer, resolve_dtype, tokenize_prompt

CODE_SAMPLES = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n\tdef __init__(self, x, y):  \n\t\tself.x, self.y = x, y\n\n\n\n# trailing spaces   \n",
    "s = 'naïve café ☕ 日本語 🐍'  # non-ASCII\r\nx = {'k': [1, 2.5e-3, None]}\n",
    "   leading spaces and <|endoftext|> written out as text",
    "",
]

# A recipe small enough to train in about a second, with the same stages as the real one.
TINY = replace(
    demo.DEFAULT_RECIPE,
    vocab_size=320,
    seq_len=32,
    batch_size=2,
    target=demo.Shape(layers=2, hidden=128, intermediate=256, heads=2),
    draft=demo.Shape(layers=1, hidden=64, intermediate=128, heads=1),
    pretrain_steps=3,
    grow_steps=2,
    distill_steps=2,
    warmup_steps=1,
    max_train_files=30,
    eval_prompts=2,
    eval_new_tokens=8,
)


def _other_tokenizer(path, chat_template: str | None = None):
    """A small byte-level BPE tokenizer unrelated to the demo's, saved at `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CODE_SAMPLES * 3, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="<s>")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)
    return tokenizer


# --- the built toy pair (opt-in) ----------------------------------------------------------------------
# These need the trained pair itself: they check the build that benchmarks/ reproduces the benchmark log's
# measurements on (its files, sizes and measured goals). The suite skips them unless SPECQ_TEST_TOY_PAIR=1.


def test_demo_folders_load_with_from_pretrained(demo_pair):
    for folder in (demo_pair.target_dir, demo_pair.draft_dir):
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder)
        assert tokenizer.is_fast
        assert tokenizer.eos_token == tokenizer.bos_token == tokenizer.pad_token == demo.EOT
        assert isinstance(model, LlamaForCausalLM)
        assert model.config.vocab_size >= len(tokenizer)
        assert model.config.eos_token_id == tokenizer.eos_token_id
        assert (folder / "model.safetensors").is_file()


def test_demo_pair_shares_vocab_and_draft_is_much_smaller(demo_pair):
    pair = load_pair(str(demo_pair.target_dir), str(demo_pair.draft_dir))
    assert pair.draft is not None and not pair.target.training and not pair.draft.training
    assert pair.tokenizer.get_vocab() == load_tokenizer(str(demo_pair.draft_dir)).get_vocab()
    assert pair.target.dtype == torch.float32
    assert pair.target.config._attn_implementation == "sdpa"
    target_params = demo.param_count(pair.target)
    draft_params = demo.param_count(pair.draft)
    assert draft_params * 5 < target_params
    assert demo_pair.report["target_params"] == target_params


def test_demo_report_meets_the_goals(demo_pair):
    report = demo_pair.report
    summary = json.dumps({k: v for k, v in report.items() if k != "recipe"})
    # Goals: a >= 0.6 and c <= 0.2; the asserts leave room for a machine busy while it measured.
    assert report["acceptance_rate"] >= 0.5, summary
    assert report["cost_ratio"] <= 0.35, summary
    assert report["speedup_bound_k4"] > 1.2, summary
    expected = leviathan_bound(report["acceptance_rate"], report["cost_ratio"], 4)
    assert report["speedup_bound_k4"] == pytest.approx(expected, abs=0.01)


def test_demo_greedy_output_is_not_one_token_repeated(demo_pair):
    """Briefly trained, the target loops, but over code-shaped tokens, not a single one."""
    tokenizer = AutoTokenizer.from_pretrained(demo_pair.target_dir)
    model = AutoModelForCausalLM.from_pretrained(demo_pair.target_dir).eval()
    for prompt in demo.heldout_prompts(3):
        ids = torch.tensor([tokenize_prompt(tokenizer, prompt=prompt)])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)
        new = out[0, ids.shape[1] :].tolist()
        assert len(set(new)) >= 5, tokenizer.decode(new)


def test_cli_module_does_not_import_torch():
    code = "import sys, specq.cli.main, specq.cli.demo_models; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --- loading errors -----------------------------------------------------------------------------------


def test_load_pair_missing_model_names_it(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ModelLoadError, match="no-such-model"):
        load_pair(missing)


def test_load_model_missing_weights_names_it(tmp_path):
    _other_tokenizer(tmp_path / "only-a-tokenizer")
    with pytest.raises(ModelLoadError, match=r"cannot load the model .*only-a-tokenizer"):
        load_model(str(tmp_path / "only-a-tokenizer"))


def test_load_pair_rejects_a_draft_with_another_vocabulary(tiny_pair, tmp_path):
    target = tiny_pair[0]
    other = tmp_path / "other-draft"
    _other_tokenizer(other)
    with pytest.raises(ModelLoadError, match="does not share the vocabulary") as info:
        load_pair(target, str(other))
    assert "other-draft" in str(info.value) and target in str(info.value)
    assert "\n" not in str(info.value)


def test_resolve_dtype():
    assert resolve_dtype(None, "cpu") == torch.float32
    assert resolve_dtype(None, "cuda:0") == torch.bfloat16
    assert resolve_dtype("bf16", "cpu") == resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    assert resolve_dtype("fp16", "cpu") == resolve_dtype("float16", "cpu") == torch.float16
    assert resolve_dtype("FP32", "cuda") == torch.float32
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        resolve_dtype("int8", "cpu")


# --- tokenization -------------------------------------------------------------------------------------


def _bos_tokenizer(tiny_pair, path):
    """tiny_pair's tokenizer made to open every text with BOS, as many models' tokenizers do (the
    toy pair's among them), saved at `path`; its chat template opens with BOS too."""
    from tokenizers import processors

    tokenizer = load_tokenizer(tiny_pair[0])
    bos = tokenizer.bos_token
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tokenizer.bos_token_id)]
    )
    tokenizer.chat_template = "{{ bos_token }}" + tokenizer.chat_template
    tokenizer.save_pretrained(path)
    return load_tokenizer(str(path))


def test_tokenize_plain_prompt_starts_with_bos_and_round_trips(tiny_pair, tmp_path):
    tokenizer = _bos_tokenizer(tiny_pair, tmp_path / "bos")
    prompt = "def add(a, b):\n    return a + b"
    ids = tokenize_prompt(tokenizer, prompt=prompt)
    assert all(isinstance(i, int) for i in ids)
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids[1:]) == prompt


def test_tokenize_chat_messages(tiny_pair, tmp_path):
    tokenizer = _bos_tokenizer(tiny_pair, tmp_path / "bos")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"}]
    ids = tokenize_prompt(tokenizer, messages=messages)
    assert isinstance(ids, list) and all(type(i) is int for i in ids)
    assert ids[0] == tokenizer.bos_token_id
    text = tokenizer.decode(ids[1:])
    assert text == "<|system|>\nBe brief.\n<|user|>\ndef add(a, b):\n<|assistant|>\n"


def test_tokenize_chat_without_template_fails_clearly(tmp_path):
    tokenizer = _other_tokenizer(tmp_path / "plain")
    with pytest.raises(ModelLoadError, match="no chat template"):
        tokenize_prompt(tokenizer, messages=[{"role": "user", "content": "hi"}])


def test_tokenize_needs_exactly_one_input(tiny_pair):
    tokenizer = load_tokenizer(tiny_pair[0])
    with pytest.raises(ValueError):
        tokenize_prompt(tokenizer)
    with pytest.raises(ValueError):
        tokenize_prompt(tokenizer, prompt="x", messages=[{"role": "user", "content": "x"}])


@pytest.mark.parametrize("text", CODE_SAMPLES)
def test_tokenizer_round_trips_code(tiny_pair, text):
    tokenizer = load_tokenizer(tiny_pair[0])
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_tokenizer_round_trips_heldout_prompts(tiny_pair):
    tokenizer = load_tokenizer(tiny_pair[0])
    for prompt in demo.heldout_prompts(20):
        assert tokenizer.decode(tokenize_prompt(tokenizer, prompt=prompt), skip_special_tokens=True) == prompt


# --- corpus, determinism, growth ----------------------------------------------------------------------


def test_heldout_prompts_are_deterministic_and_held_out():
    prompts = demo.heldout_prompts(8, prompt_chars=200)
    assert prompts == demo.heldout_prompts(8, prompt_chars=200)
    assert len(set(prompts)) == 8
    assert all(60 <= len(p) <= 200 and "def " in p.splitlines()[0] for p in prompts)
    train, heldout = demo.split_files(demo.corpus_files())
    assert len(heldout) >= 20 and not set(train) & set(heldout)
    heldout_text = "".join(demo.read_source(p) for p in heldout)
    assert all(p in heldout_text for p in prompts)
    assert not any("site-packages" in p.parts or "test" in p.parts for p in train + heldout)


def test_tokenizer_training_is_deterministic():
    texts = [demo.read_source(p) for p in demo.corpus_files()[:40]]
    first = demo.train_tokenizer(texts, 400)
    second = demo.train_tokenizer(texts, 400)
    assert first.get_vocab() == second.get_vocab()
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()


def test_training_is_deterministic():
    texts = [demo.read_source(p) for p in demo.corpus_files()[:20]]
    tokenizer = demo.train_tokenizer(texts, TINY.vocab_size)
    tokens = demo.encode_documents(tokenizer, texts)
    runs = [demo.train_models(tokens, TINY, tokenizer.eos_token_id, seed=3) for _ in range(2)]
    for first_model, second_model in ((runs[0][0], runs[1][0]), (runs[0][1], runs[1][1])):  # target, draft
        first, second = first_model.state_dict(), second_model.state_dict()
        assert first.keys() == second.keys()
        for name in first:
            assert torch.equal(first[name], second[name]), name
    other = demo.train_models(tokens, TINY, tokenizer.eos_token_id, seed=4)[0].state_dict()
    assert not torch.equal(other["model.embed_tokens.weight"], runs[0][0].state_dict()["model.embed_tokens.weight"])


def test_grow_model_preserves_the_function():
    torch.manual_seed(0)
    small = demo.make_model(demo.Shape(layers=2, hidden=128, intermediate=344, heads=2), 512, 0, 256)
    with torch.no_grad():  # away from the init, so a wrong copy shows
        for param in small.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    big = demo.make_model(demo.Shape(layers=5, hidden=192, intermediate=512, heads=3), 512, 0, 256)
    demo.grow_model(small.eval(), big.eval())
    ids = torch.randint(0, 512, (2, 40))
    with torch.no_grad():
        small_logits, big_logits = small(ids).logits, big(ids).logits  # [2, 40, 512]
    # Not exact: RMSNorm's epsilon is added to a mean over more dimensions.
    torch.testing.assert_close(big_logits, small_logits, atol=2e-3, rtol=0)
    # The zeroed parts still get gradients: one step makes every weight matrix non-zero.
    trainer = demo.Trainer(big, 1e-3, total_steps=1, warmup_steps=1)
    trainer.lm_step(ids[:, :-1], ids[:, 1:])
    assert all(bool(p.abs().sum() > 0) for p in big.parameters())


# --- the build's cache and atomicity ------------------------------------------------------------------


def test_build_is_cached_and_atomic(tmp_path):
    out = tmp_path / "pair"
    stale = tmp_path / ".pair.tmp-left-by-a-killed-build"
    stale.mkdir()
    built = demo.build_demo_models(out, seed=1, recipe=TINY)
    assert not stale.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".pair.tmp")] == []
    report = json.loads((out / demo.MARKER).read_text())
    assert report == built.report and report["seed"] == 1 and report["version"] == demo.VERSION
    for key in ("acceptance_rate", "t_target_ms", "t_draft_ms", "cost_ratio", "speedup_bound_k4", "build_seconds"):
        assert isinstance(report[key], float), key
    mtime = (out / demo.MARKER).stat().st_mtime_ns
    again = demo.build_demo_models(out, seed=1, recipe=TINY)  # cached: nothing rebuilt
    assert again.report == built.report and (out / demo.MARKER).stat().st_mtime_ns == mtime
    # A folder without the marker (a build killed before its rename could not leave one) is rebuilt.
    (out / demo.MARKER).unlink()
    rebuilt = demo.build_demo_models(out, seed=1, recipe=TINY)
    assert (out / demo.MARKER).is_file() and rebuilt.target_dir == out / "target"
    tokenizer = AutoTokenizer.from_pretrained(rebuilt.draft_dir)
    assert tokenizer.chat_template == demo.CHAT_TEMPLATE
