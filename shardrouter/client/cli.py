"""The `shard-router` command: money movements from a shell, with durable operations and safe retries.

    shard-router transfer --from alice --to bob --amount 25.00 --currency EUR [--reference R]
    shard-router deposit --account alice --amount 10.00 --currency EUR [--reference R]
    shard-router balance alice
    shard-router get-transfer --from alice TRANSFER_ID [--wait-ms 5000]
    shard-router pending            # operations not finished (pending or needing reconciliation)
    shard-router resume             # send every pending operation again, with its original key
    shard-router dev up ...         # local cluster (the `localcluster` package handles `dev`)

Every keyed RPC of the public API is an operation subcommand: its name is the RPC's operation kind
(`shardrouter.client.kinds`, read from the proto's declarations; `refund_all` -> `refund-all`).
`transfer` and `deposit` have the hand-written flags above (a decimal `--amount`, `--from`/`--to`);
any other's flags are its request's string and integer fields by name (`--account-id`,
`--amount-amount-minor`), the routing field required.

Global flags (before or after the subcommand): --target (default $SHARD_ROUTER_TARGET or
127.0.0.1:50051), --store (default $SHARD_ROUTER_STORE, else
$XDG_DATA_HOME/shard-router/operations.db or ~/.local/share/shard-router/operations.db), --caller
(default $SHARD_ROUTER_CALLER), --json, --budget-s, --attempt-timeout-s.

Every transfer and deposit is first stored in the operation store with a new UUIDv7 idempotency
key, then sent; if the command dies or gives up, `resume` finishes it without applying it twice.

Each transfer or deposit is named by its operation id and its idempotency key (made here, before
sending) and, once the service answered, by the server's id (the transfer id, or the deposit's ledger
entry id); the output labels each one, in text and in --json (`operation_id`, `idempotency_key`,
`transfer_id`, `entry_id`, null until known).

An unknown flag is refused with exit 2, naming the closest valid one.

Exit codes: 0 ok; 1 refused by the service (insufficient funds, unknown account, ...); 2 usage error
or invalid argument; 3 unavailable: no answer within the retry budget (the operation stays pending:
run `resume`); 4 needs reconciliation (the key expired before an answer was recorded).
"""

from __future__ import annotations

import argparse
import difflib
import enum
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import grpc
from google.protobuf.descriptor import FieldDescriptor

from shardrouter.client.client import SendResult, TransferClient
from shardrouter.client.kinds import OPERATION_TYPES, Argument, OperationKind, OperationType
from shardrouter.client.money import AmountError, format_amount, parse_amount
from shardrouter.client.operation import Operation, OperationState
from shardrouter.client.status import RpcFailure
from shardrouter.client.store import SqliteOperationStore
from shardrouter.client.wire import InvalidOperation, deposit_arguments, message_to_dict, transfer_arguments
from shardrouter.core import tracing
from shardrouter.v1 import transfer_pb2

__all__ = ["OPERATION_COMMANDS", "ExitCode", "build_parser", "check_flags", "default_store_path", "main"]

DEFAULT_TARGET = "127.0.0.1:50051"


class ExitCode(enum.IntEnum):
    """What the process exit status means."""

    OK = 0
    REFUSED = 1
    USAGE = 2
    UNAVAILABLE = 3
    NEEDS_RECONCILIATION = 4


def default_store_path(env: Mapping[str, str] | None = None) -> Path:
    """$SHARD_ROUTER_STORE, else the operation database under the user's data directory."""
    env = os.environ if env is None else env
    if env.get("SHARD_ROUTER_STORE"):
        return Path(env["SHARD_ROUTER_STORE"])
    base = Path(env["XDG_DATA_HOME"]) if env.get("XDG_DATA_HOME") else Path.home() / ".local" / "share"
    return base / "shard-router" / "operations.db"


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The argument parser (global flags are accepted before and after the subcommand)."""
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(
        prog="shard-router",
        description="idempotent money transfers through shard-router",
        epilog="exit codes: 0 ok, 1 refused, 2 usage/invalid argument, 3 unavailable (operation kept "
        "pending: run 'resume'), 4 needs reconciliation",
    )
    _add_global_options(parser, env, suppress=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        _add_global_options(p, env, suppress=True)
        return p

    for name, (_, kind_command) in OPERATION_COMMANDS.items():
        kind_command.add_flags(command(name, kind_command.help))

    balance = command("balance", "show an account's balance")
    balance.add_argument("account")

    get = command("get-transfer", "show a transfer and its delivery history")
    get.add_argument("--from", dest="source", required=True, metavar="ACCOUNT", help="the source account")
    get.add_argument("transfer_id")
    get.add_argument("--wait-ms", type=int, default=0, help="wait up to this long for a pending transfer")

    command("pending", "list operations that are not finished")
    command("resume", "send every pending operation again, with its original idempotency key")
    dev = sub.add_parser("dev", help="run shard-router on this machine (see 'shard-router dev --help')")
    dev.add_argument("rest", nargs=argparse.REMAINDER)
    reshard = sub.add_parser(
        "reshard", help="move a slot range to another shard (see 'shard-router reshard --help')"
    )
    reshard.add_argument("rest", nargs=argparse.REMAINDER)
    reconcile = sub.add_parser(
        "reconcile",
        help="compare the shards' databases, report and repair what they disagree on "
        "(see 'shard-router reconcile --help')",
    )
    reconcile.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def _add_global_options(parser: argparse.ArgumentParser, env: Mapping[str, str], *, suppress: bool) -> None:
    def default(value: object) -> object:
        return argparse.SUPPRESS if suppress else value

    parser.add_argument(
        "--target",
        default=default(env.get("SHARD_ROUTER_TARGET") or DEFAULT_TARGET),
        help=f"router (or shard) address (default $SHARD_ROUTER_TARGET or {DEFAULT_TARGET})",
    )
    parser.add_argument(
        "--store",
        type=Path,
        default=default(default_store_path(env)),
        help="operation store, a SQLite file (default $SHARD_ROUTER_STORE or the user data directory)",
    )
    parser.add_argument(
        "--caller", default=default(env.get("SHARD_ROUTER_CALLER") or None), help="caller id (x-caller-id)"
    )
    parser.add_argument("--json", action="store_true", default=default(False), help="machine-readable output")
    parser.add_argument(
        "--budget-s", type=float, default=default(30.0), help="total time for all attempts (default 30)"
    )
    parser.add_argument(
        "--attempt-timeout-s", type=float, default=default(2.0), help="deadline of one attempt (default 2)"
    )


# argparse keeps its option and subcommand tables in underscored attributes; typeshed types them.
def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def check_flags(parser: argparse.ArgumentParser, args: Sequence[str]) -> str | None:
    """The message refusing the first unknown `--flag` in `args` (with the closest valid one), or None.

    argparse alone would report a misspelt required flag (`--form` for `--from`) as the missing
    `--from`, and a misspelt optional one only as "unrecognized arguments"; Python 3.11's argparse
    has no suggestions. The flags valid for a command are the global ones and the command's own;
    a unique prefix of one is accepted, as argparse accepts it.
    """
    valid = dict(parser._option_string_actions)
    commands = _subcommands(parser)
    command: str | None = None
    unknown: str | None = None
    takes_value = False
    for arg in args:
        if arg == "--":
            break
        if takes_value:  # the value of the option before, whatever it looks like
            takes_value = False
            continue
        if arg.startswith("--"):
            name = arg.split("=", 1)[0]
            matches = [option for option in valid if option.startswith(name)]
            if not matches:
                unknown = unknown or name
                continue
            action = valid[name] if name in valid else valid[matches[0]]
            takes_value = "=" not in arg and action.nargs != 0
        elif command is None and arg in commands:
            command = arg
            if command == "dev":  # the rest is the dev cluster's own command line
                break
            valid.update(commands[command]._option_string_actions)
    if unknown is None:
        return None
    # Matched against the flags of the command named anywhere on the line, not only those before it.
    close = difflib.get_close_matches(unknown, [o for o in valid if o.startswith("--")], n=1)
    usage = f"{parser.prog} {command}" if command else parser.prog
    hint = f"did you mean {close[0]}?" if close else f"see '{usage} --help'"
    return f"{parser.prog}: unknown flag {unknown} ({hint})"


@dataclass(frozen=True, slots=True)
class _KindCommand:
    """The subcommand of one operation kind: its help, its flags, and the operation they make."""

    help: str
    add_flags: Callable[[argparse.ArgumentParser], None]
    arguments: Callable[[argparse.Namespace], dict[str, Argument]]
    describe: Callable[[Mapping[str, Argument]], str]


def _transfer_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from", dest="source", required=True, metavar="ACCOUNT")
    parser.add_argument("--to", dest="destination", required=True, metavar="ACCOUNT")
    _money_flags(parser, "25.00")


def _deposit_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--account", required=True)
    _money_flags(parser, "10.00")


def _money_flags(parser: argparse.ArgumentParser, example: str) -> None:
    parser.add_argument("--amount", required=True, help=f"decimal amount, e.g. {example}")
    parser.add_argument("--currency", required=True, help="ISO 4217 code, e.g. EUR")
    parser.add_argument("--reference", default="", help="free text, at most 140 characters")


def _transfer_arguments(ns: argparse.Namespace) -> dict[str, Argument]:
    currency = ns.currency.upper()
    amount = parse_amount(ns.amount, currency)
    return transfer_arguments(ns.source, ns.destination, amount, currency, ns.reference)


def _deposit_arguments(ns: argparse.Namespace) -> dict[str, Argument]:
    currency = ns.currency.upper()
    return deposit_arguments(ns.account, parse_amount(ns.amount, currency), currency, ns.reference)


def _describe_transfer(a: Mapping[str, Argument]) -> str:
    return f"{_money(int(a['amount_minor']), str(a['currency']))} {a['source']} -> {a['destination']}"


def _describe_deposit(a: Mapping[str, Argument]) -> str:
    return f"{_money(int(a['amount_minor']), str(a['currency']))} to {a['account']}"


#: The operation kinds whose flags are written by hand (decimal amounts, short account flags), by
#: kind; every other kind's subcommand is derived from its request (`_derived_command`).
_HAND_WRITTEN: Mapping[OperationKind, _KindCommand] = {
    "transfer": _KindCommand(
        "move money from one account to another", _transfer_flags, _transfer_arguments, _describe_transfer
    ),
    "deposit": _KindCommand(
        "credit an account from outside (opens it on the first deposit)",
        _deposit_flags,
        _deposit_arguments,
        _describe_deposit,
    ),
}


def _flag(argument: str) -> str:
    return "--" + argument.replace("_", "-").replace(".", "-")


def _derived_command(op_type: OperationType) -> _KindCommand:
    """A subcommand whose flags are the kind's arguments: one per string or integer request field."""
    routing = op_type.declaration.routing_field

    def add_flags(parser: argparse.ArgumentParser) -> None:
        for argument, (path, field) in op_type.arguments.items():
            integer = field.type != FieldDescriptor.TYPE_STRING
            parser.add_argument(
                _flag(argument),
                dest=f"argument:{argument}",
                type=int if integer else str,
                required=path == routing,
                metavar="N" if integer else "TEXT",
                help=f"the request's {path}",
            )

    def arguments(ns: argparse.Namespace) -> dict[str, Argument]:
        given = {a: getattr(ns, f"argument:{a}", None) for a in op_type.arguments}
        return {a: value for a, value in given.items() if value is not None}

    def describe(a: Mapping[str, Argument]) -> str:
        return ", ".join(f"{name}={value}" for name, value in a.items()) or "no arguments"

    help_text = f"send {op_type.declaration.name} (stored with a new idempotency key, then sent)"
    return _KindCommand(help_text, add_flags, arguments, describe)


#: Subcommand name -> (operation kind, its subcommand), one per keyed RPC of the public API.
OPERATION_COMMANDS: Mapping[str, tuple[OperationKind, _KindCommand]] = {
    kind.replace("_", "-"): (kind, _HAND_WRITTEN.get(kind) or _derived_command(op_type))
    for kind, op_type in OPERATION_TYPES.items()
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `shard-router`; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    refused = check_flags(parser, args)
    if refused is not None:
        print(refused, file=sys.stderr)
        return int(ExitCode.USAGE)
    ns = parser.parse_args(args)  # other usage errors exit with 2
    if ns.command == "dev":
        # `shard-router` (localcluster.command) hands `dev` to the local cluster before this runs.
        print(f"{parser.prog}: 'dev' is served by the shard-router command, not this module", file=sys.stderr)
        return int(ExitCode.USAGE)
    out = _Output(json_mode=ns.json)
    # Off unless OTEL_* asks for it; then each operation and attempt is a span (shardrouter.client.tracing).
    tracing.configure_tracing("shard-router-cli")
    try:
        if ns.command in ("balance", "get-transfer"):
            with TransferClient(ns.target, store=None, caller_id=ns.caller) as client:
                return _read(ns, client, out)
        with SqliteOperationStore(ns.store) as store:
            with TransferClient(ns.target, store=store, caller_id=ns.caller) as client:
                return _operations(ns, client, store, out)
    except (AmountError, InvalidOperation) as error:
        return out.failure(
            ExitCode.USAGE, f"{ns.command}: {error}", {"command": ns.command, "error": str(error)}
        )
    finally:
        tracing.shutdown_tracing()  # export what is queued before the process ends


def _operations(
    ns: argparse.Namespace, client: TransferClient, store: SqliteOperationStore, out: _Output
) -> int:
    timing = {"budget_s": ns.budget_s, "attempt_timeout_s": ns.attempt_timeout_s}
    if ns.command in OPERATION_COMMANDS:
        kind, kind_command = OPERATION_COMMANDS[ns.command]
        op = client.create_operation(kind, kind_command.arguments(ns))
        return out.send_result(client.send_with_retries(op, **timing))
    if ns.command == "pending":
        unfinished = store.list_operations({OperationState.PENDING, OperationState.NEEDS_RECONCILIATION})
        return out.pending(unfinished)
    results = client.resume_pending(**timing)
    return out.resumed(results)


def _read(ns: argparse.Namespace, client: TransferClient, out: _Output) -> int:
    try:
        if ns.command == "balance":
            return out.balance(client.get_balance(ns.account, timeout_s=ns.attempt_timeout_s))
        reply = client.get_transfer(ns.source, ns.transfer_id, ns.wait_ms, timeout_s=ns.attempt_timeout_s)
        return out.transfer(reply.transfer)
    except RpcFailure as failure:
        code = _exit_for_code(failure.code)
        reason = f" ({failure.details.reason})" if failure.details.reason else ""
        data = {
            "command": ns.command,
            "code": failure.code.name,
            "reason": failure.details.reason,
            "message": failure.message,
        }
        return out.failure(code, f"{ns.command} failed: {failure.code.name}{reason}: {failure.message}", data)


def _exit_for_code(code: grpc.StatusCode) -> ExitCode:
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return ExitCode.UNAVAILABLE
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        return ExitCode.USAGE
    return ExitCode.REFUSED


def _exit_code_of(result: SendResult) -> ExitCode:
    """The exit code for a `send_with_retries` result."""
    state = result.state
    if state is OperationState.SUCCEEDED:
        return ExitCode.OK
    if state is OperationState.NEEDS_RECONCILIATION:
        return ExitCode.NEEDS_RECONCILIATION
    if state is OperationState.PENDING:
        return ExitCode.UNAVAILABLE
    return ExitCode.USAGE if result.code is grpc.StatusCode.INVALID_ARGUMENT else ExitCode.REFUSED


def _describe(op: Operation) -> str:
    """A short human description of an operation's arguments."""
    for kind, kind_command in OPERATION_COMMANDS.values():
        if kind == op.kind:
            try:
                return kind_command.describe(op.arguments)
            except (KeyError, ValueError):  # stored without a field its description shows
                break
    return ", ".join(f"{name}={value}" for name, value in op.arguments.items())


def _money(amount_minor: int, currency: str) -> str:
    try:
        return f"{format_amount(amount_minor, currency)} {currency}"
    except AmountError:
        return f"{amount_minor} {currency} (minor units)"


def _state_name(value: int) -> str:
    return transfer_pb2.TransferState.Name(value).removeprefix("TRANSFER_STATE_")


class _Output:
    """Prints one summary line per result (or JSON) and returns the exit code."""

    def __init__(
        self, *, json_mode: bool, stdout: TextIO | None = None, stderr: TextIO | None = None
    ) -> None:
        self.json_mode = json_mode
        self.stdout = stdout or sys.stdout
        self.stderr = stderr or sys.stderr

    def _emit(self, code: ExitCode, line: str, data: dict[str, Any]) -> int:
        if self.json_mode:
            print(json.dumps({**data, "exit_code": int(code)}, sort_keys=True), file=self.stdout)
        else:
            print(line, file=self.stdout if code is ExitCode.OK else self.stderr)
        return int(code)

    def failure(self, code: ExitCode, line: str, data: dict[str, Any]) -> int:
        return self._emit(code, line, data)

    def send_result(self, result: SendResult) -> int:
        return self._emit(_exit_code_of(result), _summary(result), _result_data(result))

    def resumed(self, results: list[SendResult]) -> int:
        code = max((_exit_code_of(r) for r in results), default=ExitCode.OK)
        if self.json_mode:
            data = {"command": "resume", "results": [_result_data(r) for r in results]}
            return self._emit(code, "", data)
        if not results:
            print("no pending operations", file=self.stdout)
        for result in results:
            target = self.stdout if _exit_code_of(result) is ExitCode.OK else self.stderr
            print(_summary(result), file=target)
        return int(code)

    def pending(self, operations: list[Operation]) -> int:
        if self.json_mode:
            return self._emit(
                ExitCode.OK, "", {"command": "pending", "operations": [o.to_dict() for o in operations]}
            )
        if not operations:
            print("no unfinished operations", file=self.stdout)
        for op in operations:
            last = op.attempts[-1].code if op.attempts else "never sent"
            print(
                f"{_operation_ids(op)} {op.kind} {op.state.value}: {_describe(op)}, "
                f"{len(op.attempts)} attempt{'s' if len(op.attempts) != 1 else ''}, last {last}",
                file=self.stdout,
            )
        return int(ExitCode.OK)

    def balance(self, reply: transfer_pb2.GetBalanceResponse) -> int:
        state = transfer_pb2.AccountState.Name(reply.state).removeprefix("ACCOUNT_STATE_")
        money = _money(reply.balance.amount_minor, reply.balance.currency)
        data = {"command": "balance", **(message_to_dict(reply) or {}), "formatted": money}
        return self._emit(ExitCode.OK, f"{reply.account_id}: {money} ({state})", data)

    def transfer(self, transfer: transfer_pb2.Transfer) -> int:
        line = (
            f"transfer {transfer.transfer_id} {_state_name(transfer.state)}: "
            f"{_money(transfer.amount.amount_minor, transfer.amount.currency)} "
            f"{transfer.source_account_id} -> {transfer.destination_account_id}"
        )
        if transfer.delivery_attempts:
            line += f", {len(transfer.delivery_attempts)} delivery attempts"
        data = {"command": "get-transfer", "transfer": message_to_dict(transfer)}
        return self._emit(ExitCode.OK, line, data)


def _operation_ids(op: Operation) -> str:
    """The local names of an operation, labelled: `operation <id> (key <idempotency key>)`."""
    return f"operation {op.id} (key {op.idempotency_key})"


def _server_ids(result: SendResult) -> dict[str, str | None]:
    """The ids the service gave (None until it answered OK): a transfer's id, a deposit's entry id."""
    response = result.response if result.ok else None
    transfer = response.transfer.transfer_id if isinstance(response, transfer_pb2.TransferResponse) else None
    entry = response.entry_id if isinstance(response, transfer_pb2.DepositResponse) else None
    return {"transfer_id": transfer or None, "entry_id": entry or None}


def _summary(result: SendResult) -> str:
    """One line; every line names the operation and its key, so the ids a user sees never change:
    the server's id (`transfer <id>`, `deposit entry <id>`) is added once the service gave one."""
    op = result.operation
    ids = _operation_ids(op)
    replayed = " (replayed)" if result.replayed else ""
    response = result.response
    if result.state is OperationState.SUCCEEDED and result.ok:
        if isinstance(response, transfer_pb2.TransferResponse):
            t = response.transfer
            return (
                f"transfer {t.transfer_id} {_state_name(t.state)}: "
                f"{_money(t.amount.amount_minor, t.amount.currency)} "
                f"{t.source_account_id} -> {t.destination_account_id}{replayed}; {ids}"
            )
        if isinstance(response, transfer_pb2.DepositResponse):
            balance = _money(response.balance.amount_minor, response.balance.currency)
            return (
                f"deposit entry {response.entry_id} OK: {_describe(op)}, balance {balance}{replayed}; {ids}"
            )
        return f"{op.kind} OK: {_describe(op)}{replayed}; {ids}"
    problem = f"{result.code.name}{f' ({result.reason})' if result.reason else ''}: {result.message}"
    if result.state is OperationState.PENDING:
        why = "retry budget exhausted" if result.budget_exhausted else "no definite answer"
        return (
            f"{op.kind} {ids} still pending ({why} after {result.attempts} attempts; last {problem}); "
            f"{_describe(op)}; run 'shard-router resume' to finish it with the same key"
        )
    if result.state is OperationState.NEEDS_RECONCILIATION:
        return f"{op.kind} {ids} needs reconciliation: {_describe(op)}: {problem}"
    if op.state is OperationState.SUCCEEDED:  # a re-send of a finished operation failed transiently
        return f"{op.kind} {ids} already succeeded; the re-send answered {problem}"
    verb = "invalid" if result.code is grpc.StatusCode.INVALID_ARGUMENT else "refused"
    violations = "".join(f"; {f}: {d}" for f, d in (result.error.field_violations if result.error else ()))
    return f"{op.kind} {verb}{replayed}: {_describe(op)}: {problem}{violations}; {ids}"


def _result_data(result: SendResult) -> dict[str, Any]:
    error = result.error
    return {
        "command": result.operation.kind,
        # Every id, always present (null until known), so scripts need not guess which one they got.
        "operation_id": result.operation.id,
        "idempotency_key": result.operation.idempotency_key,
        **_server_ids(result),
        "operation": result.operation.to_dict(),
        "result": {
            "code": result.code.name,
            "message": result.message,
            "reason": result.reason,
            "replayed": result.replayed,
            "attempts": result.attempts,
            "budget_exhausted": result.budget_exhausted,
            "state": result.state.value,
            "response": message_to_dict(result.response),
            "error": None
            if error is None
            else {
                "reason": error.reason,
                "domain": error.domain,
                "metadata": dict(error.metadata),
                "retry_delay_s": error.retry_delay_s,
                "field_violations": [list(v) for v in error.field_violations],
            },
        },
    }


if __name__ == "__main__":
    raise SystemExit(main())
