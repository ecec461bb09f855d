"""The `shard-router` command end to end: a subprocess against the in-process shard's port."""

from __future__ import annotations

from pathlib import Path

from shardrouter.client.cli import default_store_path
from shardrouter.shardd.server import ShardDaemon
from tests.client.cli_helpers import balance_of, child_env, cli, ledger_count


def test_deposit_transfer_balance_and_exit_codes(shard: ShardDaemon, database: str, tmp_path: Path) -> None:
    target = f"127.0.0.1:{shard.port}"
    store = tmp_path / "ops.db"

    def run(*args: str):
        return cli(tmp_path, "--target", target, *args, store=store)

    dep = run("deposit", "--account", "alice", "--amount", "10.00", "--currency", "EUR")
    assert dep.code == 0, dep.output
    assert (
        dep.stdout.startswith("deposit entry ") and "OK: 10.00 EUR to alice, balance 10.00 EUR" in dep.stdout
    )
    assert run("deposit", "--account", "bob", "--amount", "0.01", "--currency", "eur").code == 0

    tr = run("transfer", "--from", "alice", "--to", "bob", "--amount", "2.50", "--currency", "EUR")
    assert tr.code == 0, tr.output
    line = tr.stdout.strip()
    assert line.startswith("transfer ") and "COMPLETED: 2.50 EUR alice -> bob; operation " in line, line
    transfer_id = line.split()[1]

    bal = run("balance", "alice")
    assert (bal.code, bal.stdout.strip()) == (0, "alice: 7.50 EUR (OPEN)")
    assert balance_of(database, "bob") == 251

    got = run("get-transfer", "--from", "alice", transfer_id, "--wait-ms", "100")
    assert got.code == 0 and got.stdout.strip() == f"transfer {transfer_id} COMPLETED: 2.50 EUR alice -> bob"

    poor = run("transfer", "--from", "bob", "--to", "alice", "--amount", "99.00", "--currency", "EUR")
    assert poor.code == 1, poor.output
    assert "refused" in poor.stderr and "INSUFFICIENT_FUNDS" in poor.stderr and poor.stdout == ""

    bad = run("transfer", "--from", "alice", "--to", "bob", "--amount", "1.001", "--currency", "EUR")
    assert bad.code == 2 and "EUR has 2 decimal places" in bad.stderr
    same = run("transfer", "--from", "alice", "--to", "alice", "--amount", "1.00", "--currency", "EUR")
    assert same.code == 2 and "destination_account_id must differ" in same.stderr
    usage = run("transfer", "--from", "alice")
    assert usage.code == 2 and "required" in usage.stderr
    unknown = run("balance", "nobody")
    assert unknown.code == 1 and "ACCOUNT_NOT_FOUND" in unknown.stderr

    js = run("--json", "transfer", "--from", "alice", "--to", "bob", "--amount", "1.00", "--currency", "EUR")
    data = js.json()
    assert js.code == 0 and data["exit_code"] == 0
    assert data["result"]["code"] == "OK" and data["result"]["replayed"] is False
    assert data["operation"]["state"] == "succeeded"
    assert data["result"]["response"]["transfer"]["amount"] == {"amount_minor": "100", "currency": "EUR"}
    key = data["operation"]["idempotency_key"]
    assert (data["operation_id"], data["idempotency_key"]) == (data["operation"]["id"], key)
    assert data["transfer_id"] == data["result"]["response"]["transfer"]["transfer_id"]
    assert data["entry_id"] is None
    assert ledger_count(database, key) == 2
    js_bal = run("balance", "alice", "--json").json()
    assert js_bal["formatted"] == "6.50 EUR" and js_bal["exit_code"] == 0

    pending = run("pending")
    assert pending.code == 0 and pending.stdout.strip() == "no unfinished operations"


def test_unreachable_target_exits_3_keeps_the_operation_pending_and_resume_finishes_it(
    shard: ShardDaemon, database: str, tmp_path: Path
) -> None:
    store = tmp_path / "ops.db"
    down = cli(
        tmp_path,
        "--target", "127.0.0.1:1", "--budget-s", "0.5", "--attempt-timeout-s", "0.2",
        "deposit", "--account", "dora", "--amount", "3.00", "--currency", "EUR",
        store=store,
    )  # fmt: skip
    assert down.code == 3, down.output
    assert "still pending" in down.stderr and "shard-router resume" in down.stderr
    listed = cli(tmp_path, "pending", store=store)
    assert listed.code == 0 and " deposit pending: 3.00 EUR to dora" in listed.stdout
    (ids,) = [ln.split(" deposit pending")[0] for ln in listed.stdout.splitlines()]
    assert ids.startswith("operation ") and " (key " in ids, ids
    assert f"deposit {ids} still pending" in down.stderr, down.stderr
    resumed = cli(tmp_path, "--target", f"127.0.0.1:{shard.port}", "resume", store=store)
    assert resumed.code == 0, resumed.output
    assert "OK: 3.00 EUR to dora" in resumed.stdout and "(replayed)" not in resumed.stdout
    # The same operation and key as while it was pending, beside the entry id the shard gave.
    assert resumed.stdout.startswith("deposit entry ") and resumed.stdout.strip().endswith(f"; {ids}")
    assert balance_of(database, "dora") == 300
    again = cli(tmp_path, "--target", f"127.0.0.1:{shard.port}", "resume", store=store)
    assert again.stdout.strip() == "no pending operations"
    assert balance_of(database, "dora") == 300


def test_default_store_lives_in_the_user_data_dir(shard: ShardDaemon, tmp_path: Path) -> None:
    env = child_env(tmp_path, SHARD_ROUTER_TARGET=f"127.0.0.1:{shard.port}")
    run = cli(tmp_path, "deposit", "--account", "erin", "--amount", "1", "--currency", "JPY", env=env)
    assert run.code == 0, run.output
    assert (tmp_path / "xdg" / "shard-router" / "operations.db").is_file()
    assert default_store_path({"HOME": "/h"}).parent.name == "shard-router"
    assert default_store_path({"XDG_DATA_HOME": "/d"}) == Path("/d/shard-router/operations.db")


def test_dev_is_dispatched_to_the_devcluster_cli(tmp_path: Path) -> None:
    run = cli(tmp_path, "dev", "--help")
    assert run.code == 0 and "shard-router dev" in run.stdout


def test_otel_environment_traces_the_command_without_touching_its_output(
    shard: ShardDaemon, tmp_path: Path
) -> None:
    env = child_env(tmp_path, OTEL_TRACES_EXPORTER="console", OTEL_SERVICE_NAME="cli-test")
    run = cli(
        tmp_path,
        "--target",
        f"127.0.0.1:{shard.port}",
        "--json",
        "deposit",
        "--account",
        "zoe",
        "--amount",
        "1.00",
        "--currency",
        "EUR",
        store=tmp_path / "ops.db",
        env=env,
    )
    assert run.code == 0, run.output
    reply = run.json()  # stdout is still exactly one JSON object
    key = reply["operation"]["idempotency_key"]
    assert '"name": "shardrouter.client.operation"' in run.stderr, run.stderr
    assert '"name": "shardrouter.v1.TransferService/Deposit"' in run.stderr
    assert f'"idempotency.key": "{key}"' in run.stderr
    assert '"service.name": "cli-test"' in run.stderr


def test_every_line_and_json_object_names_operation_key_and_server_id(
    shard: ShardDaemon, tmp_path: Path
) -> None:
    """One operation has local ids (operation, key) and, once answered, the server's: all labelled."""
    store = tmp_path / "ops.db"

    def run(*args: str, target: str = f"127.0.0.1:{shard.port}"):
        return cli(
            tmp_path,
            "--target",
            target,
            "--budget-s",
            "0.5",
            "--attempt-timeout-s",
            "0.2",
            *args,
            store=store,
        )

    dep = run("--json", "deposit", "--account", "alice", "--amount", "5.00", "--currency", "EUR").json()
    entry_id = dep["result"]["response"]["entry_id"]
    assert (dep["operation_id"], dep["idempotency_key"], dep["entry_id"], dep["transfer_id"]) == (
        dep["operation"]["id"],
        dep["operation"]["idempotency_key"],
        entry_id,
        None,
    )
    assert run("deposit", "--account", "bob", "--amount", "1.00", "--currency", "EUR").code == 0

    # Pending: only the local ids are known, and both are labelled (null server ids in JSON).
    down = run("--json", "transfer", "--from", "alice", "--to", "bob", "--amount", "1.00", "--currency", "EUR",
               target="127.0.0.1:1")  # fmt: skip
    pending = down.json()
    assert down.code == 3 and pending["result"]["state"] == "pending"
    op_id, key = pending["operation_id"], pending["idempotency_key"]
    assert (op_id, key) == (pending["operation"]["id"], pending["operation"]["idempotency_key"])
    assert op_id != key and pending["transfer_id"] is None and pending["entry_id"] is None
    text = run("transfer", "--from", "alice", "--to", "bob", "--amount", "1.00", "--currency", "EUR",
               target="127.0.0.1:1")  # fmt: skip
    (line,) = [ln for ln in text.stderr.splitlines() if " still pending " in ln]
    assert text.code == 3 and line.startswith("transfer operation ") and " (key " in line, line

    # Completed: the same operation and key, now beside the transfer id.
    done = run("--json", "resume").json()
    first = next(r for r in done["results"] if r["operation_id"] == op_id)
    assert first["idempotency_key"] == key
    assert first["transfer_id"] == first["result"]["response"]["transfer"]["transfer_id"]
    assert first["entry_id"] is None

    refused = run("transfer", "--from", "bob", "--to", "alice", "--amount", "99.00", "--currency", "EUR")
    assert refused.code == 1 and "INSUFFICIENT_FUNDS" in refused.stderr
    assert "; operation " in refused.stderr and " (key " in refused.stderr, refused.stderr


def test_unknown_flags_are_refused_with_the_closest_valid_one(tmp_path: Path) -> None:
    store = tmp_path / "ops.db"
    typo = cli(tmp_path, "transfer", "--form", "alice", "--to", "bob", "--amount", "1", "--currency", "EUR",
               store=store)  # fmt: skip
    assert typo.code == 2
    assert typo.stderr.strip() == "shard-router: unknown flag --form (did you mean --from?)", typo.stderr
    assert typo.stdout == "" and not store.exists(), "refused before anything was stored or sent"

    optional = cli(
        tmp_path, "deposit", "--account", "a", "--amount", "1", "--currency", "EUR", "--refrence", "x"
    )
    assert optional.code == 2
    assert optional.stderr.strip() == "shard-router: unknown flag --refrence (did you mean --reference?)"
    glob = cli(tmp_path, "--jsn", "balance", "alice")
    assert (glob.code, glob.stderr.strip()) == (2, "shard-router: unknown flag --jsn (did you mean --json?)")
    valued = cli(tmp_path, "balance", "alice", "--targt=127.0.0.1:1")
    assert valued.stderr.strip() == "shard-router: unknown flag --targt (did you mean --target?)"
    far = cli(tmp_path, "balance", "alice", "--xyzzy")
    assert (far.code, far.stderr.strip()) == (
        2,
        "shard-router: unknown flag --xyzzy (see 'shard-router balance --help')",
    )
    # Values are not flags, and argparse's unique prefixes still work.
    from shardrouter.client.cli import build_parser, check_flags

    parser = build_parser({})
    assert check_flags(parser, ["transfer", "--reference", "--form", "--from", "a"]) is None
    assert (
        check_flags(parser, ["transfer", "--fro", "a", "--to", "b", "--amount", "1", "--currency", "EUR"])
        is None
    )
    assert check_flags(parser, ["dev", "up", "--no-such-dev-flag"]) is None  # the dev CLI checks its own
