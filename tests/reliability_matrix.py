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
        "sets the chunk aside (dead-letter list, counted in metrics and `specq workers`) and keeps serving; "
        "the right fleet's sweeper enqueues it again",
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
    Row(
        "input",
        "`draft train` -> `submit --draft DIR --wait` (the README's flow), embedded and through a real worker",
        "the head folder is taken by `run`, `submit` and workers by one rule; the target's own greedy tokens exported",
        NONE_LOST,
        (
            "tests/test_hostile_round3_heads.py::test_the_readme_flow_trains_submits_to_a_worker_and_exports_the_targets_own_completions",
            "tests/test_hostile_round3_heads.py::test_an_embedded_submit_takes_the_head_folder_too",
        ),
    ),
    Row(
        "input",
        "a draft head with negative, repeated or out-of-range vocabulary ids, NaN weights, "
        "or a 2 KB config implying gigabytes",
        "one line, exit 2, at load and at submit, before anything is allocated",
        NOTHING,
        (
            "tests/test_hostile_round3_heads.py::test_a_broken_head_is_refused_by_a_load_in_one_line",
            "tests/test_hostile_round3_heads.py::test_a_config_implying_gigabytes_is_refused_before_the_weights_are_read_or_anything_built",
            "tests/test_hostile_round3_heads.py::test_a_head_with_a_negative_vocabulary_id_is_refused_by_run_and_submit_with_exit_2",
        ),
    ),
    Row(
        "fault",
        "the Docker image's contents: what the Dockerfile copies, installed into a fresh folder",
        "every module of specq imports (distill/ was missing); no hand list of parts",
        NONE_LOST,
        (
            "tests/test_image_install.py::test_what_the_dockerfile_copies_installs_and_imports_every_module",
            "tests/test_image_install.py::test_the_dockerfile_names_no_part_by_hand",
        ),
    ),
    Row(
        "security",
        "`draft train -o TARGET --overwrite` (or -o inside the target, holding the data, the data directory, a link)",
        "refused, exit 2, before anything is touched; `--overwrite` removes only a folder draft train wrote",
        NOTHING,
        (
            "tests/test_hostile_round3_draft_train.py::test_overwrite_of_the_target_folder_is_refused_and_the_target_is_whole",
            "tests/test_hostile_round3_draft_train.py::test_overwrite_deletes_no_model_folder_it_did_not_write",
            "tests/test_hostile_round3_draft_train.py::test_a_symbolic_link_dir_with_overwrite_is_refused_and_nothing_lands_where_it_points",
            "tests/test_hostile_round3_draft_train.py::test_specqs_data_directory_is_refused_as_dir_as_its_parent_and_inside_it",
        ),
    ),
    Row(
        "fault",
        "one chunk message naming another database, taken by a live fleet",
        "set aside by the first worker, which then completes a normal job; "
        "a submit from a client on another database is refused",
        NONE_LOST,
        (
            "tests/test_hostile_round3_queue.py::test_a_message_for_another_database_is_set_aside_once_and_the_worker_keeps_serving",
            "tests/test_hostile_round3_queue.py::test_a_stopped_worker_leaves_no_entry_and_a_refused_submit_needs_a_live_one",
        ),
    ),
    Row(
        "input",
        "a GGUF header declaring 3,000,000 tensors (and counts, lengths, arrays past the file's end)",
        "refused before any reader is built: one line, exit 2",
        NOTHING,
        (
            "tests/test_hostile_round3_gguf.py::test_three_million_declared_tensors_are_refused_before_any_reader",
            "tests/test_hostile_round3_gguf.py::test_many_real_small_tensors_over_the_cap_are_refused_in_bounded_memory",
            "tests/test_hostile_round3_gguf.py::test_a_hostile_header_is_one_line_naming_what_is_wrong",
        ),
    ),
    Row(
        "fault",
        "a `train:N` head that took no step, or drafts worse than none; a token budget far beyond its data",
        "stored untrained/rejected, the job goes on without it and `status` says with what; "
        "training ends at its wall-time bound",
        NONE_LOST,
        (
            "tests/test_hostile_round3_train_jobs.py::test_a_head_whose_budget_ran_out_before_a_step_is_untrained_and_the_job_goes_on_without_it",
            "tests/test_hostile_round3_train_jobs.py::test_the_training_phase_ends_by_its_budget_in_wall_time_whatever_the_data",
            "tests/test_hostile_round3_train_jobs.py::test_a_head_that_measures_worse_than_no_draft_is_rejected_and_one_that_learnt_is_kept",
        ),
    ),
    Row(
        "race",
        "cancel, then retry, five times over a job whose worker held started requests (`--max-attempts 2`)",
        "no attempt spent, no suspect; 40 of 40 complete",
        NONE_LOST,
        (
            "tests/test_hostile_round3_recovery.py::test_cancel_then_retry_five_times_spends_no_attempt_and_the_job_completes",
        ),
    ),
    Row(
        "fault",
        "a poisoned request among 16 suspects of a killed worker",
        "isolated by bisection: at most 4 deaths and 9 engine runs (17 runs one by one before); "
        "the other 15 are target-only's tokens",
        "0 / 0 / 1",
        (
            "tests/test_hostile_round3_recovery.py::test_a_poisoned_suspect_is_isolated_by_bisection_in_about_log2_n_batches",
            "tests/test_hostile_round3_recovery.py::test_suspects_split_in_halves_and_untried_halves_stay_whole",
        ),
    ),
    Row(
        "input",
        "a budget of 1 and 400 zeros (`train:5:1000...`, `--budget`)",
        "one-line usage error, exit 2 (no OverflowError)",
        NOTHING,
        ("tests/test_hostile_round3_draft_train.py::test_budget_and_submit_draft_train_of_hundreds_of_digits_exit_2",),
    ),
    Row(
        "security",
        "a template's `raise_exception` text and GGUF metadata with newlines and terminal escapes",
        "shown escaped, in one line",
        NOTHING,
        (
            "tests/test_hostile_round3_gguf.py::test_a_templates_raise_exception_text_is_escaped",
            "tests/test_hostile_round3_gguf.py::test_gguf_metadata_in_a_message_is_escaped",
        ),
    ),
    Row(
        "fault",
        "a damaged converted GGUF folder; a conversion killed mid-way",
        "found by its record and converted again, errors naming the folder; "
        "the stale temporary folder removed by the next conversion",
        NONE_LOST,
        (
            "tests/test_hostile_round3_gguf.py::test_a_damaged_conversion_is_found_and_converted_again",
            "tests/test_hostile_round3_gguf.py::test_a_killed_conversions_folder_is_removed_by_the_next_conversion_of_any_file",
        ),
    ),
    Row(
        "input",
        "a GGUF whose own chat template is over 256 KiB",
        "refused as `--chat-template` is: one line, exit 2",
        NOTHING,
        ("tests/test_hostile_round3_gguf.py::test_a_gguf_chat_template_over_the_limit_is_refused",),
    ),
    Row(
        "fault",
        "target weights whose logits go NaN or infinite for one request of a batch",
        "that request fails naming the token; the others are target-only's",
        "0 / 0 / 1",
        (
            "tests/test_hostile_round3_nonfinite.py::test_nan_logits_mid_completion_fail_that_request_alone",
            "tests/test_hostile_round3_nonfinite.py::test_run_fails_the_request_with_nan_logits_with_exit_1_and_the_error_in_its_line",
            "tests/test_hostile_round3_nonfinite.py::test_a_draft_whose_logits_are_all_nan_never_changes_the_output",
        ),
    ),
    Row(
        "output",
        "an over-context request in `run` and in `draft train`",
        "counted failed in the progress line as in the summary; `draft train` exits 2 naming the line",
        NOTHING,
        (
            "tests/test_hostile_round3_draft_train.py::test_run_counts_an_over_context_request_as_failed_in_its_progress_line_as_in_its_summary",
            "tests/test_hostile_round3_draft_train.py::test_draft_train_refuses_an_over_context_prompt_as_a_bad_line_before_anything_is_written",
        ),
    ),
    Row(
        "output",
        "an embedded `submit` cancelled from another process",
        "progress while it runs; exit 1",
        NONE_LOST,
        ("tests/test_hostile_round3_queue.py::test_a_cancelled_embedded_submit_exits_1_and_shows_its_progress",),
    ),
    Row(
        "fault",
        "the suite's Redis databases holding someone else's keys",
        "other free databases taken (or a private server); foreign keys only read",
        NONE_LOST,
        (
            "tests/test_redis_db_choice.py::test_the_choice_skips_a_database_holding_foreign_keys",
            "tests/test_redis_db_choice.py::test_with_no_free_database_left_a_private_server_is_started",
        ),
    ),
    Row(
        "fault",
        "a catalogue pull whose parts assemble to another file, lack a part, or meet a full disk",
        "one line, exit 1, nothing kept",
        NOTHING,
        (
            "tests/test_catalogue.py::test_parts_that_do_not_assemble_to_the_catalogue_file_keep_nothing",
            "tests/test_catalogue.py::test_a_missing_part_keeps_nothing",
            "tests/test_catalogue.py::test_a_full_disk_is_one_line_and_keeps_nothing",
        ),
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
