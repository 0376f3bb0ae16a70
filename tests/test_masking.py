"""Every credential form is masked wherever a URL is shown (issue 14, item 8): userinfo, `password=`,
`sslpassword=`, tokens and keys in query strings; in error messages, the worker's start-up line and
logs, tracebacks, and `ps` (a worker's command line)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from specq.masking import credentials_of, mask_url
from tests.fleet_helpers import wait_for
from tests.services import invoke, services_env

SECRET = "s3cr3t-Pa55"

FORMS = [
    ("postgresql+psycopg://u:{s}@h:5432/db", "postgresql+psycopg://u:***@h:5432/db"),
    (
        "postgresql+psycopg://u@h/db?password={s}&sslmode=require",
        "postgresql+psycopg://u@h/db?password=***&sslmode=require",
    ),
    ("postgresql://h/db?sslpassword={s}", "postgresql://h/db?sslpassword=***"),
    ("redis://:{s}@h:6379/0", "redis://:***@h:6379/0"),
    ("redis://h/0?password={s}", "redis://h/0?password=***"),
    ("https://h/x?access_token={s}&a=1", "https://h/x?access_token=***&a=1"),
    ("http://h/?api_key={s}", "http://h/?api_key=***"),
    ("postgresql://u:p%40{s}@h/db", "postgresql://u:***@h/db"),
    ("host=h password={s} dbname=x", "host=h password=*** dbname=x"),
    ("redis://user:**@h:6379/15", "redis://user:***@h:6379/15"),  # Celery's own mask, made specq's
    ("postgresql+psycopg://postgres@127.0.0.1:5432/specq", "postgresql+psycopg://postgres@127.0.0.1:5432/specq"),
]


@pytest.mark.parametrize(("url", "masked"), FORMS)
def test_every_credential_form_is_masked(url: str, masked: str) -> None:
    assert mask_url(url.format(s=SECRET)) == masked


def test_the_secrets_of_a_url_are_found_to_mask_them_anywhere() -> None:
    url = f"postgresql://u:{SECRET}@h/db?sslpassword=p%2Fx&token=t0k&sslmode=require"
    assert credentials_of(url) == {SECRET, "p/x", "t0k"}


def test_errors_tracebacks_logs_and_ps_show_no_credential(pg_db_url, redis_url, tmp_path) -> None:
    home = tmp_path / "home"
    # an unreachable database named with each form: one line, exit 1, masked
    for form in ("?password={s}", "?sslpassword={s}&password={s}"):
        down = pg_db_url.replace(":5432/", ":1/") + form.format(s=SECRET)
        result = invoke(["status"], services_env(down, None, home, SPECQ_OUTAGE_PATIENCE_S="0"))
        assert result.exit_code == 1 and SECRET not in result.output and "***" in result.output, result.output

    # an uncaught exception's traceback, in a process that uses the URL
    url = f"{pg_db_url}?password={SECRET}"
    code = "import sys; from specq.masking import register_urls as r; r(sys.argv[1]); raise RuntimeError(sys.argv[1])"
    done = subprocess.run([sys.executable, "-c", code, url], capture_output=True, text=True, timeout=60)
    assert "Traceback" in done.stderr and SECRET not in done.stderr and "password=***" in done.stderr, done.stderr

    # a worker given the URL on its command line: its start-up line and logs, and what `ps` shows
    args = [sys.executable, "-m", "specq", "worker", "--device", "cpu", "--database-url", url]
    log_path = tmp_path / "flagged.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            args, env=services_env(pg_db_url, redis_url, home), stdout=log, stderr=subprocess.STDOUT
        )
    try:
        wait_for(lambda: " ready." in log_path.read_text(), 60, "the worker to be ready")
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode(errors="replace")
        assert SECRET not in cmdline and "password=***" in cmdline, cmdline
    finally:
        proc.terminate()
        proc.wait(60)
    output = log_path.read_text()
    assert SECRET not in output and "results in postgresql+psycopg://" in output and "password=***" in output, output
