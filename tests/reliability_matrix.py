"""The fault matrix of docs/reliability.md (issue 14): each row, what was tried, what happened, what it
cost in requests, and the tests that show it. `scripts/reliability_matrix.py` runs those tests and
writes the table, each row with its tests' outcome; tests/test_reliability_doc.py checks the doc is
current with this registry.

A row's outcome: `passed` when all its tests passed; `known bug` when one is an expected failure
(`xfail(strict=True)`, with the bug as its reason); `FAILED` when one failed; `skipped` when one was skipped
(a service missing); `pending` when a test is not in this branch yet (an item another branch delivers).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "reliability.md"
START = "<!-- reliability-matrix:start -->"
END = "<!-- reliability-matrix:end -->"
NOTHING = "none (nothing stored)"
NONE_LOST = "0 / 0 / 0"


@dataclass(frozen=True)
class Row:
    area: str
    tried: str
    happened: str
    cost: str  # requests lost / duplicated / failed
    tests: tuple[str, ...]  # pytest node ids, without parameters


ROWS: tuple[Row, ...] = (
    # -- bad input ---------------------------------------------------------------------------------------------
    Row(
        "input",
        "invalid UTF-8, arrays, numbers, strings as lines, NaN and Infinity",
        "`INPUT:LINE:` error each, exit 2",
        NOTHING,
        ("tests/test_inputs.py::test_plain_line_errors",),
    ),
    Row(
        "input",
        "a UTF-8 BOM",
        "ignored; the first line reads as usual",
        NONE_LOST,
        ("tests/test_inputs.py::test_utf8_bom_and_unicode",),
    ),
    Row(
        "input",
        "CRLF line endings",
        "read as LF: the same outputs",
        NONE_LOST,
        ("tests/test_hostile_files.py::test_crlf_line_endings_read_as_lf",),
    ),
    Row(
        "input",
        "a 50 MB line (and a line or file over the limits)",
        "`INPUT:1:` the line is too long, exit 2, in about 1 s",
        NOTHING,
        (
            "tests/test_hostile_files.py::test_a_50_mb_line_is_a_line_error_and_nothing_runs",
            "tests/test_hardening.py::test_line_and_file_limits",
        ),
    ),
    Row(
        "input",
        "JSON nested 100k deep; a chat `role` that is an array",
        "`INPUT:LINE:` errors, exit 2",
        NOTHING,
        (
            "tests/test_hostile.py::test_hostile_lines_stop_run_and_submit_with_line_errors",
            "tests/test_inputs.py::test_hostile_lines_are_line_errors",
        ),
    ),
    Row(
        "input",
        "extreme integers: `top_k` 2**63 and 2**64-1, as a line and as `--top-k`",
        "`INPUT:LINE:` must be in [0, 2147483647], exit 2",
        NOTHING,
        ("tests/test_hostile.py::test_hostile_lines_stop_run_and_submit_with_line_errors",),
    ),
    Row(
        "input",
        "extreme temperatures: 1e-40, 1e-300, 5e-324, 1e-6",
        "decoded greedily: exactly the greedy tokens, with and without a draft",
        NONE_LOST,
        ("tests/test_hostile.py::test_tiny_temperatures_decode_greedily",),
    ),
    Row(
        "input",
        "an unknown key holding a newline",
        "echoed JSON-quoted: no forged report line",
        NOTHING,
        ("tests/test_inputs.py::test_echoed_keys_and_values_cannot_forge_report_lines",),
    ),
    Row(
        "input",
        "ids with newlines, commas, quotes, a CR, a formula",
        "kept exactly in `run`'s jsonl and in CSV (`--csv-raw`)",
        NONE_LOST,
        ("tests/test_hostile_files.py::test_ids_with_newlines_commas_and_quotes_survive_jsonl_and_csv",),
    ),
    Row(
        "input",
        "duplicate ids in a file",
        "every duplicate reported, exit 2",
        NOTHING,
        ("tests/test_inputs.py::test_every_bad_line_reported_in_order_with_duplicates",),
    ),
    Row(
        "input",
        "duplicate ids through a pipe (`run /dev/stdin`)",
        "BUG: exit 0, no duplicate reported, nothing run (INPUT is read twice)",
        "all lost (0 of 2 run)",
        ("tests/test_hostile_files.py::test_duplicate_ids_through_a_pipe_are_line_errors",),
    ),
    Row(
        "input",
        "a FIFO as INPUT",
        "BUG: the second read waits for a writer that is gone (INPUT is read twice)",
        "all lost (hangs)",
        ("tests/test_hostile_files.py::test_a_fifo_as_input_is_read_once",),
    ),
    Row(
        "input",
        "an empty file",
        "`INPUT: the file has no requests`, exit 2",
        NOTHING,
        ("tests/test_queue_errors.py::test_empty_file_is_bad_input",),
    ),
    Row(
        "input",
        "a folder as INPUT",
        "one line, exit 2",
        NOTHING,
        ("tests/test_hostile_files.py::test_a_folder_as_input_is_one_line",),
    ),
    Row(
        "input",
        "a file of bad lines through `submit`",
        "every bad line reported, exit 2",
        NOTHING,
        ("tests/test_queue_errors.py::test_bad_lines_all_reported_nothing_stored",),
    ),
    # -- outputs -----------------------------------------------------------------------------------------------
    Row(
        "output",
        "`export -o` a FIFO, /dev/null, /dev/stdout, a link",
        "written through; the node or link kept",
        NONE_LOST,
        (
            "tests/test_hostile.py::test_export_writes_through_fifos_devices_and_links",
            "tests/test_hostile.py::test_export_replaces_a_links_target_and_keeps_the_link",
        ),
    ),
    Row(
        "output",
        "`export -o` into a missing folder or /sys",
        "one line, exit 2",
        NONE_LOST,
        ("tests/test_hostile.py::test_export_to_a_path_that_cannot_be_written",),
    ),
    Row(
        "output",
        "`run -o OUT` with a bad input",
        "OUT untouched, exit 2",
        NOTHING,
        ("tests/test_hostile.py::test_run_checks_the_input_before_it_touches_out",),
    ),
    Row(
        "output",
        "completions and ids beginning with = + - @ tab CR, exported to CSV",
        "defused with a leading `'`; `--csv-raw` exact",
        NONE_LOST,
        ("tests/test_hostile.py::test_csv_export_defused_by_default_exact_with_csv_raw",),
    ),
    # -- job-control races ---------------------------------------------------------------------------------------
    Row(
        "race",
        "`retry` right after `cancel`, while a worker settles the cancel (held open by a row lock)",
        "the retry waits for the job's lock, says why it did nothing; the next retry requeues all; the job completes",
        "0 / 0 / 0",
        (
            "tests/test_races.py::test_retry_while_a_worker_settles_a_cancel_ends_the_job",
            "tests/test_hostile.py::test_retry_right_after_cancel_says_what_it_did",
        ),
    ),
    Row(
        "race",
        "`cancel` and a worker's claim of a queued job (held open by a row lock)",
        "no deadlock: the claim waits, finds the job cancelled, claims nothing",
        NONE_LOST,
        ("tests/test_races.py::test_cancel_and_a_claim_of_a_queued_job_do_not_deadlock",),
    ),
    Row(
        "race",
        "`cancel` while workers run the job",
        "running requests end, the rest cancelled; nothing runs after",
        "0 lost / 0 / 0 (the rest cancelled)",
        ("tests/test_queue.py::test_cancel_while_running",),
    ),
    Row(
        "race",
        "Ctrl-C during an in-process `submit`, then `retry`",
        "the job is cancelled, `retry` resumes it",
        NONE_LOST,
        ("tests/test_queue_embedded.py::test_ctrl_c_cancels_the_embedded_job_so_retry_can_resume_it",),
    ),
    Row(
        "race",
        '`status ""` and other commands with an empty job id',
        "refused, exit 2",
        NONE_LOST,
        ("tests/test_hostile.py::test_an_empty_job_id_is_refused",),
    ),
    # -- faults ------------------------------------------------------------------------------------------------------
    Row(
        "fault",
        "kill -9 of a worker mid-batch",
        "its leases expire, the other worker redoes the chunk; outputs those of `specq run`",
        NONE_LOST,
        ("tests/test_recovery.py::test_worker_killed_mid_batch_matches_specq_run",),
    ),
    Row(
        "fault",
        "kill -9 mid-chunk, a seeded sampled job (T 0.7-1.0, top-p, top-k)",
        "completions and tokens byte-identical to the undisturbed run",
        NONE_LOST,
        ("tests/test_seeded_retry.py::test_seeded_sampled_job_is_byte_identical_after_a_kill_9",),
    ),
    Row(
        "fault",
        "a request that SIGKILLs every worker running it, under `specq autoscale`",
        "workers replaced; the request fails after `--max-attempts`; the others complete",
        "0 / 0 / 1 (the poison request)",
        ("tests/test_fleet.py::test_autoscale_zero_to_n_to_zero_crash_loop_and_sigterm",),
    ),
    Row(
        "fault",
        "Redis restarted mid-job (every message lost)",
        "lost chunks enqueued again by the sweepers; the job completes",
        NONE_LOST,
        ("tests/test_recovery.py::test_redis_restart_mid_job",),
    ),
    Row(
        "fault",
        "PostgreSQL restarted mid-job",
        "chunk tasks wait and retry; the job completes",
        NONE_LOST,
        ("tests/test_recovery.py::test_postgres_restart_mid_job",),
    ),
    Row(
        "fault",
        "Redis then PostgreSQL restarted during `submit --wait`; `status`, `workers`, `export` started "
        "while PostgreSQL is down",
        "one warning line each, then the normal result; exit 0",
        NONE_LOST,
        ("tests/test_outages.py::test_waits_and_polls_ride_out_postgres_and_redis_restarts",),
    ),
    Row(
        "fault",
        "the database gone for longer than SPECQ_OUTAGE_PATIENCE_S; a bad value of it",
        "one warning, then one error line, exit 1; a bad value is one line naming it, exit 2",
        NONE_LOST,
        ("tests/test_outages.py::test_a_hard_outage_is_one_line_and_a_bad_patience_is_named",),
    ),
    Row(
        "fault",
        "the broker down at `submit`",
        "one line, exit 1",
        NOTHING,
        ("tests/test_queue_errors.py::test_broker_down_stores_nothing",),
    ),
    Row(
        "fault",
        "the database down at `submit` and every other command",
        "one line each, exit 1, password masked",
        NOTHING,
        ("tests/test_queue_errors.py::test_database_down_every_command",),
    ),
    Row(
        "fault",
        "a full disk under the embedded SQLite store at `submit` (RLIMIT_FSIZE)",
        "one line, exit 1",
        NOTHING,
        ("tests/test_hostile_files.py::test_a_full_disk_for_the_results_database_is_one_line_and_stores_nothing",),
    ),
    Row(
        "fault",
        "a bad SPECQ_LEASE_S",
        "one line naming it, exit 2; `status` and `run` unaffected",
        NOTHING,
        ("tests/test_hostile.py::test_bad_queue_timings_are_one_line_for_the_commands_that_use_them",),
    ),
    Row(
        "fault",
        "out of memory above 2 requests a batch",
        "batches halved until they fit; a request too big alone fails alone",
        "0 / 0 / 1 (the one that fits nowhere)",
        (
            "tests/test_recovery_oom.py::test_batches_split_until_they_fit",
            "tests/test_recovery_oom.py::test_a_request_that_does_not_fit_alone_fails_alone",
        ),
    ),
    # -- security ------------------------------------------------------------------------------------------------------
    Row(
        "security",
        "a pickled task message on the queue",
        "refused, never unpickled; nothing claimed or stored",
        NONE_LOST,
        ("tests/test_hardening.py::test_pickle_refused_and_credentials_masked",),
    ),
    Row(
        "security",
        "credentials as userinfo, `password=`, `sslpassword=`, tokens and keys in queries, libpq strings",
        "each shown as `***`",
        NONE_LOST,
        ("tests/test_masking.py::test_every_credential_form_is_masked",),
    ),
    Row(
        "security",
        "a password in the URLs: errors, "
        "an uncaught traceback, the worker's start-up line and logs, `ps` of a worker given it as a flag",
        "masked everywhere",
        NONE_LOST,
        (
            "tests/test_masking.py::test_errors_tracebacks_logs_and_ps_show_no_credential",
            "tests/test_hardening.py::test_pickle_refused_and_credentials_masked",
        ),
    ),
    Row(
        "security",
        "`ps` of the workers `specq autoscale` starts",
        "service URLs only in their environment",
        NONE_LOST,
        ("tests/test_fleet.py::test_autoscale_zero_to_n_to_zero_crash_loop_and_sigterm",),
    ),
    Row(
        "security",
        "`body.model` naming the draft's folder, /etc/passwd, a Hub id",
        "ignored: the target decodes, and is reported",
        NONE_LOST,
        ("tests/test_hostile_files.py::test_body_model_never_loads_another_model_or_path",),
    ),
    Row(
        "security",
        "`--metrics-port` binding and the model names it shows (issue 14, item 9)",
        "127.0.0.1 by default; served names, not paths",
        NONE_LOST,
        ("tests/test_fleet_operable.py::test_misconfigured_workers_fail_nothing_and_the_good_one_is_seen",),
    ),
    # -- hostile input and faults, second round (issue 36) ------------------------------------------------------
    Row(
        "input",
        "a chat template that loops 10^10 times, or builds a 10 GB string (`--chat-template`, 2 chat lines)",
        "`INPUT:LINE:` error each (past its time bound, over 1 GiB), exit 2, the submit bounded; no worker renders",
        NOTHING,
        ("tests/test_hostile_round2.py::test_a_template_that_hangs_or_hogs_is_a_bad_line_at_submit",),
    ),
    Row(
        "fault",
        "an older job's chat line (not rendered at submit) whose template never ends, under a real worker",
        "counted started, then failed at the time bound with the reason; the plain request of its chunk completes",
        "0 / 0 / 1 (the chat line)",
        ("tests/test_hostile_round2.py::test_a_worker_renders_an_old_jobs_chat_lines_under_the_bounds",),
    ),
    Row(
        "race",
        "a cancelled job's worker frozen (SIGSTOP) with its 40 requests claimed, killed, another worker started",
        "its sweeper ends them cancelled, never queued under the cancelled job; `retry` runs them: 40 completed",
        NONE_LOST,
        ("tests/test_hostile_round2.py::test_a_cancelled_jobs_dead_worker_leaves_its_requests_cancelled",),
    ),
    Row(
        "security",
        "1 MB adversarial texts through credential masking (letter runs, schemes, long users and passwords)",
        "each masked within 5 s of CPU (linear; it was quadratic: 18 s for 40 KB)",
        NONE_LOST,
        (
            "tests/test_hostile_round2.py::test_masking_is_linear_on_adversarial_text",
            "tests/test_hostile_round2.py::test_masking_still_finds_credentials_after_any_prefix",
        ),
    ),
    Row(
        "race",
        "retention of an expired job whose requests run under live leases; `SPECQ_RETENTION=1s`",
        "kept until they end, then deleted (the rule of `delete`); under 1 h refused unless said to be meant",
        NONE_LOST,
        ("tests/test_hostile_round2.py::test_retention_deletes_nothing_in_flight_and_has_a_floor",),
    ),
    Row(
        "race",
        "the job deleted while `export` streams it (csv, jsonl, openai)",
        "export fails (exit 1) naming the job; the file left as it was",
        NONE_LOST,
        ("tests/test_hostile_round2.py::test_export_fails_when_its_job_is_deleted_while_it_streams",),
    ),
    Row(
        "output",
        "a line of `n` = 4 cancelled after 2 choices, in 3 formats with both filters",
        "OpenAI: the 2 choices, and an error saying 2 were cut; an error line in every format and filter",
        NONE_LOST,
        ("tests/test_hostile_round2.py::test_a_partly_run_n_line_exports_its_completed_choices_everywhere_alike",),
    ),
    Row(
        "output",
        "a stop string that begins inside a token",
        "the text cut where the stop string begins (as OpenAI and vLLM), that token kept",
        NONE_LOST,
        ("tests/test_stopping.py::test_a_stop_string_spanning_tokens_and_steps",),
    ),
    Row(
        "input",
        "`--chat-template /dev/zero`, a template over 256 KiB",
        "one line, exit 2; nothing read past 256 KiB",
        NOTHING,
        ("tests/test_hostile_round2.py::test_a_chat_template_is_bounded_in_size_and_read_once",),
    ),
    Row(
        "input",
        "`?password=` in the broker URL, alone and beside a userinfo password",
        "moved into the userinfo; given twice one line, exit 2; masked either way",
        NONE_LOST,
        ("tests/test_hostile_round2.py::test_a_password_query_in_the_broker_url_is_accepted_or_refused_in_one_line",),
    ),
    Row(
        "input",
        "`--metadata` with a newline (a forged `status` line), an escape sequence, a bell",
        "refused, exit 2",
        NOTHING,
        ("tests/test_hostile_round2.py::test_metadata_with_control_characters_is_refused",),
    ),
    Row(
        "output",
        "a job stored before that refusal: a newline, escape sequences and C1 controls in its metadata, a "
        "carriage return in its input's name",
        "`status` writes each control character as its escape: no forged line, nothing raw reaches the "
        "terminal; `--json` keeps them exact",
        NONE_LOST,
        ("tests/test_hostile_round2.py::test_status_shows_stored_control_characters_escaped_and_json_exact",),
    ),
    Row(
        "input",
        "stdin or stdout closed, /dev/full as stdout, a non-UTF-8 path or served name, a 20-character "
        "completion window, `status --limit 2**63`",
        "one line each, exit 2 (1 for the full device); a non-UTF-8 path is stored printable",
        NOTHING,
        (
            "tests/test_hostile_round2.py::test_closed_and_full_standard_streams_are_one_line",
            "tests/test_hostile_round2.py::test_odd_values_are_one_line",
        ),
    ),
    Row(
        "race",
        "`retry` twice of a job whose chunks are queued",
        "the second sends nothing again: one line, exit 2",
        NONE_LOST,
        ("tests/test_hostile.py::test_retry_right_after_cancel_says_what_it_did",),
    ),
    Row(
        "output",
        "worker metrics of a job submitted with `--served-model-name`",
        "labelled with the served name (they showed the target's)",
        NONE_LOST,
        ("tests/test_hostile_round2.py::test_worker_metrics_report_the_served_model_name",),
    ),
    Row(
        "fault",
        "a worker pointed at another database than the job's",
        "gives the chunk back and exits 4 saying why; the right worker runs it",
        NONE_LOST,
        ("tests/test_hostile_round2.py::test_a_worker_on_another_database_gives_the_chunk_back",),
    ),
    Row(
        "input",
        "20,000 good lines, then a bad one (PostgreSQL)",
        "rejected; the rows its COPY wrote vacuumed away at once (they stayed as dead rows)",
        NOTHING,
        ("tests/test_hostile_round2.py::test_a_rejected_submit_leaves_no_dead_rows",),
    ),
)


def defined(node: str) -> bool:
    """Whether the test function of `node` (file::name) is defined in this checkout."""
    path, name = node.split("::")
    file = ROOT / path
    if not file.exists():
        return False
    tree = ast.parse(file.read_text(encoding="utf-8"))
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body)


def row_outcome(row: Row, outcomes: dict[str, str]) -> str:
    """The row's outcome from its tests' (`passed`, `failed`, `xfailed`, `missing`, per node id)."""
    seen = [outcomes.get(node, "missing") for node in row.tests]
    if "missing" in seen:
        return "pending"
    if "skipped" in seen:
        return "skipped"
    if "failed" in seen:
        return "FAILED"
    if "xfailed" in seen:
        return "known bug"
    return "passed"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(outcomes: dict[str, str]) -> str:
    """The table, from the registry and the tests' outcomes."""
    lines = [
        "| area | what was tried | what happened | lost / duplicated / failed | outcome | tests |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in ROWS:
        tests = "<br>".join(f"`{node}`" for node in row.tests)
        cells = (row.area, row.tried, row.happened, row.cost, row_outcome(row, outcomes), tests)
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)


def outcomes_in_doc(text: str) -> dict[str, str]:
    """The outcomes the doc's table shows, per test node, read back (so the doc can be re-rendered)."""
    section = text.split(START, 1)[1].split(END, 1)[0]
    shown = {}
    for line in section.splitlines():
        if not line.startswith("| ") or line.startswith(("| area", "| ---")):
            continue
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        outcome = {
            "passed": "passed",
            "FAILED": "failed",
            "known bug": "xfailed",
            "skipped": "skipped",
            "pending": "missing",
        }[cells[4]]
        for node in cells[5].split("<br>"):
            shown[node.strip("`")] = outcome
    return shown


def section(text: str) -> str:
    return text.split(START, 1)[1].split(END, 1)[0]


def replace_section(text: str, table: str, stamp: str) -> str:
    before, rest = text.split(START, 1)
    after = rest.split(END, 1)[1]
    return f"{before}{START}\n{stamp}\n\n{table}\n{END}{after}"
