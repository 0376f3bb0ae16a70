"""A job's settings are one type at both ends (`jobs.settings.JobSettings`): what `submit` stores is the
JSON form every version wrote, and rows that older versions stored read back with the newer keys'
defaults."""

from __future__ import annotations

import json

import pytest

from specq.decoding.config import DecodingConfig
from specq.jobs.settings import JobSettings
from specq.queue import DEFAULT_MAX_ATTEMPTS


def test_the_stored_form_is_the_one_jobs_always_had() -> None:
    decoding = DecodingConfig(num_speculative_tokens=6, batch_size=4, model_free="ngram")
    settings = JobSettings(
        decoding=decoding,
        sampling={"temperature": 0.5, "max_tokens": 32},
        device="cpu",
        dtype="float32",
        chunk_size=16,
        max_attempts=2,
        compile="off",
    )
    stored = settings.to_stored()
    assert stored == {
        "decoding": decoding.to_dict(),
        "sampling": {"temperature": 0.5, "max_tokens": 32},
        "device": "cpu",
        "dtype": "float32",
        "chunk_size": 16,
        "max_attempts": 2,
        "compile": "off",
    }
    assert list(stored) == ["decoding", "sampling", "device", "dtype", "chunk_size", "max_attempts", "compile"]
    assert JobSettings.from_stored(json.loads(json.dumps(stored))) == settings


def test_an_older_row_reads_with_the_newer_keys_defaults() -> None:
    # as the first versions stored it: no max_attempts, no compile, the template of its chat lines
    old = {
        "decoding": {"num_speculative_tokens": 4, "fixed_k": False, "batch_size": 8},
        "sampling": {"temperature": 0.0},
        "device": None,
        "dtype": None,
        "chunk_size": 8,
        "chat_template": "{{ messages }}",
    }
    settings = JobSettings.from_stored(old)
    assert settings.decoding == DecodingConfig(num_speculative_tokens=4, batch_size=8)
    assert settings.sampling == {"temperature": 0.0}
    assert (settings.chunk_size, settings.max_attempts, settings.compile) == (8, DEFAULT_MAX_ATTEMPTS, "auto")
    assert settings.chat_template == "{{ messages }}"
    assert settings.to_stored()["chat_template"] == "{{ messages }}"  # kept, for the worker that renders them


@pytest.mark.parametrize("stored", [{}, {"chunk_size": 2}, {"max_attempts": None, "decoding": None}])
def test_a_sparse_row_reads_as_the_defaults(stored) -> None:
    settings = JobSettings.from_stored(stored)
    assert settings.decoding == DecodingConfig() and settings.sampling == {}
    assert settings.max_attempts == DEFAULT_MAX_ATTEMPTS and settings.compile == "auto"
    assert settings.chunk_size == stored.get("chunk_size", 0)


def test_keys_a_newer_version_added_are_ignored() -> None:
    stored = {**JobSettings(chunk_size=3).to_stored(), "priority": 7}
    stored["decoding"] = {**stored["decoding"], "draft_temperature": 0.7}
    assert JobSettings.from_stored(stored) == JobSettings(chunk_size=3)


def test_max_attempts_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_attempts must be >= 1"):
        JobSettings(max_attempts=0)
