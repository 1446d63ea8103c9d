"""`ceiling`: serve the API, manage budgets and keys, correct reservations, read health. The
same core as the API."""

from __future__ import annotations

import argparse
import asyncio
import gc
import getpass
import importlib.util
import json
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from api.runtime import Runtime, runtime, serving_as
from api.views import (
    budget_view_json,
    correction_json,
    stored_reservation_json,
    users_json,
)
from core.budgets import BudgetDef, BudgetId, Limit, ModelLimits, OutagePolicy, Period
from core.errors import CeilingError, InvalidRequest
from core.ledger import ROLES_DEFAULT, Role
from core.limits import CEILING_MICROS_MAX
from core.money import usd_to_micros
from core.reconcile import COST_REPORTS
from core.service import CeilingService, operator_fingerprint
from core.spend import budget_reading
from core.text import whole_number

if TYPE_CHECKING:
    from starlette.types import ASGIApp

KEEP_ALIVE_S = 75
# The `serve` extra (pyproject.toml), and what uvicorn falls back to without each.
SERVE_EXTRA = {"uvloop": "asyncio's event loop", "httptools": "h11"}
# What uvicorn.run exits with when its server could not start; `ceiling serve` says the same.
STARTUP_FAILURE_EXIT = 3


def _amount(text: str) -> int:
    """'1000000' is micro-dollars; '$1.00' is dollars."""
    if text.startswith("$"):
        return usd_to_micros(text[1:])
    micros = whole_number(text, len(str(CEILING_MICROS_MAX)))
    if micros is None:
        raise argparse.ArgumentTypeError(f"{text!r}: give micro-dollars (1000000) or $1.00")
    return micros


def _limit(text: str) -> Limit:
    period, _, amount = text.partition("=")
    if period not in Period.__members__.values() or not amount:
        raise argparse.ArgumentTypeError(f"{text!r}: give PERIOD=AMOUNT, PERIOD day|month|total")
    return Limit(Period(period), _amount(amount))


def _model_limit(text: str) -> tuple[str, Limit]:
    """'MODEL:PERIOD=AMOUNT' (the last ':' before the period: a model's name may hold ':')."""
    model, _, limit = text.rpartition(":")
    if not model:
        raise argparse.ArgumentTypeError(f"{text!r}: give MODEL:PERIOD=AMOUNT, e.g. "
                                         "gpt-5:day=$50")
    return model, _limit(limit)


def _per_model(given: Sequence[tuple[str, Limit]]) -> tuple[ModelLimits, ...]:
    """--model-limit's, each model's limits together, in the order first given (the service
    gives each its one name and refuses two names of one model)."""
    limits: dict[str, list[Limit]] = {}
    for model, limit in given:
        limits.setdefault(model, []).append(limit)
    return tuple(ModelLimits(m, tuple(x)) for m, x in limits.items())


def serve(args: argparse.Namespace) -> int:
    rt = Runtime.from_env(os.environ)
    if rt.service is None:
        print(f"ceiling serve: refusing to start: {rt.problem}", file=sys.stderr)
        return 2
    unaccepted = asyncio.run(rt.ledger_unaccepted())
    if unaccepted:
        print(f"ceiling serve: refusing to start: {unaccepted}", file=sys.stderr)
        return 2
    serving_as(rt.instance_id)
    missing = {m: instead for m, instead in SERVE_EXTRA.items()
               if importlib.util.find_spec(m) is None}
    if missing:
        print(f"ceiling serve: {' and '.join(missing)} not installed, so uvicorn runs on "
              f"{' and '.join(missing.values())}, at more CPU per call; "
              "pip install 'spend-ceiling[serve]' adds them", file=sys.stderr)
    if rt.config is not None and (rt.config.upstream_url or rt.config.anthropic_url):
        # The gateway's provider client (httpx, aiohttp), which a serverless instance imports
        # with its first gateway call, is imported here, before run_server freezes the start-up
        # objects: imported later, its modules' objects stay in the collector's generations and
        # every full collection walks them, pauses on the requests in flight.
        import api.transport  # noqa: F401

    from api.alerts import delivering
    from api.app import create_app

    # Alert delivery runs in the background of a long-running server.
    run_server(create_app(lifespan=delivering), args.host, args.port)
    return 0


def run_server(app: ASGIApp, host: str, port: int) -> None:
    """Serve `app` as `ceiling serve` does; the benchmarks' baselines are served by it too.

    uvicorn's `auto` loop and parser are uvloop and httptools when they are installed (the
    `serve` extra), asyncio and h11 when not."""
    import uvicorn

    # Keep-alive outlives the clients' idle expiry (httpx: 5 s), so a client never sends a
    # reserve on a connection the server is closing, where it could not tell whether it ran.
    # No WebSocket route: nothing of uvicorn's WebSocket support is loaded.
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            timeout_keep_alive=KEEP_ALIVE_S, ws="none")
    # Loaded now rather than when the server starts: what it imports (the protocol classes)
    # is then among the start-up objects frozen below.
    config.load()
    # Start-up objects live for the whole process: freezing them keeps the collector from
    # walking them on every cycle, pauses that land on the requests in flight (the tail).
    gc.collect()
    gc.freeze()
    server = uvicorn.Server(config)
    server.run()
    if not server.started:  # as uvicorn.run exits when it could not start (a port in use)
        sys.exit(STARTUP_FAILURE_EXIT)


def refused(exc: CeilingError) -> int:
    """A command's refusal: the error as the routes answer it, on stderr; exit 1."""
    print(json.dumps({"error": {"code": exc.code, "message": exc.message, **exc.details}}),
          file=sys.stderr)
    return 1


def _run(work: Callable[[CeilingService], Awaitable[Any]]) -> int:
    async def go() -> Any:
        service = runtime().enforcing()
        try:
            return await work(service)
        finally:
            await service.store.close()

    try:
        result = asyncio.run(go())
    except CeilingError as exc:
        return refused(exc)
    print(json.dumps(result, indent=2))
    return 0


async def _budget_json(service: CeilingService, budget_id: BudgetId) -> Any:
    """The budget as GET /v1/admin/budgets/{id} shows it (api/views.py budget_view_json)."""
    found = await budget_reading(service.store, budget_id)
    return None if found is None else budget_view_json(*found)


def budgets_set(args: argparse.Namespace) -> int:
    async def work(service: CeilingService) -> Any:
        bid = BudgetId.operator(args.budget_id)  # as PUT /v1/admin/budgets: no reserved kind
        policy = None if args.outage_policy is None else OutagePolicy(args.outage_policy)
        await runtime().operations().put_budget(
            BudgetDef(bid, tuple(args.limit), args.timezone, args.allowance, policy,
                      models_allow=tuple(args.model) if args.model else None,
                      per_model=_per_model(args.model_limit or ())),
            cli_operator())
        return await _budget_json(service, bid)

    return _run(work)


def budgets_show(args: argparse.Namespace) -> int:
    return _run(lambda service: _budget_json(service, BudgetId.parse(args.budget_id)))


def budgets_users(args: argparse.Namespace) -> int:
    async def work(service: CeilingService) -> Any:
        return users_json(await runtime().operations().users(
            BudgetId.parse(args.budget_id), args.cursor, args.limit))

    return _run(work)


def keys_create(args: argparse.Namespace) -> int:
    async def work(service: CeilingService) -> Any:
        roles = frozenset(args.role) if args.role else ROLES_DEFAULT
        new = await runtime().operations().create_key(BudgetId.operator(args.budget_id),
                                                   args.run_ceiling, roles, cli_operator())
        return {"key_id": new.key_id, "api_key": new.api_key, "budget_id": args.budget_id,
                "roles": sorted(new.record.roles)}

    return _run(work)


def cli_operator() -> str:
    """Who corrects from the command line: the admin token's fingerprint where the environment
    has one (as the admin route records it), else the OS user, who holds the ledger's
    credentials."""
    token = os.environ.get("CEILING_ADMIN_TOKEN")
    if token:
        return operator_fingerprint(token)
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):  # no user name in a bare container
        return "cli"


def reservations_settle(args: argparse.Namespace) -> int:
    async def work(service: CeilingService) -> Any:
        by = cli_operator()
        settled = await runtime().operations().correct(args.reservation_id, args.actual,
                                                    args.reason, by)
        return correction_json(args.reservation_id, settled, by)

    return _run(work)


def reservations_show(args: argparse.Namespace) -> int:
    async def work(service: CeilingService) -> Any:
        return stored_reservation_json(await service.inspect(args.reservation_id))

    return _run(work)


def keys_revoke(args: argparse.Namespace) -> int:
    async def work(service: CeilingService) -> Any:
        return {"key_id": args.key_id,
                "revoked": await runtime().operations().revoke_key(args.key_id, cli_operator())}

    return _run(work)


def budgets_list(args: argparse.Namespace) -> int:
    return _run(lambda service: _json(runtime().operations().budgets(args.prefix, args.cursor,
                                                                   args.limit)))


def budgets_delete(args: argparse.Namespace) -> int:
    return _run(lambda service: runtime().operations().delete_budget(
        BudgetId.parse(args.budget_id), args.force, cli_operator()))


def keys_list(args: argparse.Namespace) -> int:
    return _run(lambda service: _json(runtime().operations().keys(args.budget_id, args.cursor,
                                                                args.limit)))


def keys_rotate(args: argparse.Namespace) -> int:
    return _run(lambda service: runtime().operations().rotate_key(
        args.key_id, None if args.grace_s is None else args.grace_s * 1000, cli_operator()))


def audit_list(args: argparse.Namespace) -> int:
    return _run(lambda service: _json(runtime().operations().audit_page(args.cursor, args.limit)))


async def _json(page: Awaitable[Any]) -> Any:
    return (await page).json()


def _write_private(path: str, text: str) -> None:
    """Write whole or not at all (a crash leaves the previous export), readable by the owner
    only: an export holds every key's hash."""
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


def _read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"cannot read {path}: {exc}", field="file") from exc


def ledger_export(args: argparse.Namespace) -> int:
    async def work(service: CeilingService) -> Any:
        document = await runtime().operations().export(cli_operator())
        text = json.dumps(document, indent=1, sort_keys=True)
        if args.file == "-":
            return document
        _write_private(args.file, text)
        body = document["body"]
        return {"file": args.file, "ledger_id": document["ledger_id"],
                "organisations": len(body["organisations"]), "keys": len(body["keys"]),
                "checksum": document["checksum"]}

    return _run(work)


def ledger_restore(args: argparse.Namespace) -> int:
    async def work(service: CeilingService) -> Any:
        document = _read_json(args.file)
        bill = None if args.book_from_bill is None else _read_json(args.book_from_bill)
        return await runtime().operations().restore(document, bill, args.force, cli_operator())

    return _run(work)


def ledger_adopt(args: argparse.Namespace) -> int:
    return _run(lambda service: runtime().operations().adopt(cli_operator()))


def ledger_migrate(args: argparse.Namespace) -> int:
    from core.backends import migrate_ledger

    async def work(service: CeilingService) -> Any:
        return await migrate_ledger(runtime().store(), dry_run=args.dry_run)

    return _run(work)


# -- alerts ------------------------------------------------------------------------------------


def budgets_resume(args: argparse.Namespace) -> int:
    return _run(lambda service: runtime().operations().resume(BudgetId.parse(args.budget_id),
                                                           cli_operator()))


def alerts_deliver(args: argparse.Namespace) -> int:
    from api.alerts import deliver_once

    async def work(service: CeilingService) -> Any:
        report = await deliver_once()
        return {"delivered": None} if report is None else report.json()

    return _run(work)


def alerts_list(args: argparse.Namespace) -> int:
    from core.spend import alert_log

    async def work(service: CeilingService) -> Any:
        return {"alerts": [e.json() for e in await alert_log(runtime().store())]}

    return _run(work)


# -- reconciliation ----------------------------------------------------------------------------

# `ceiling reconcile` exits with this when a day's drift is beyond the tolerance (0: every day is
# within it; 1: the comparison could not be made): a scheduler tells drift from failure.
DRIFT_EXIT = 3


def reconcile(args: argparse.Namespace) -> int:
    """Print each day's ledger, provider and drift (with --book-into, what was booked); exit 0
    within the tolerance, DRIFT_EXIT beyond it, 1 when a report or the ledger could not be read
    (never a zero), or the budget to book into is not one."""
    from api.routes.reconcile import run_reconcile
    from core.reconcile import Reconciled, book_into_of, provider_of, tolerance_of

    async def go() -> Reconciled:
        try:
            return await run_reconcile(provider_of(args.provider), args.first, args.last,
                                       tolerance_of(args.tolerance_pct),
                                       book_into=book_into_of(args.book_into),
                                       by=cli_operator())
        finally:
            if runtime().service is not None:
                await runtime().store().close()

    try:
        done = asyncio.run(go())
    except CeilingError as exc:
        return refused(exc)
    print(json.dumps(done.json(), indent=2) if args.json else "\n".join(done.lines()))
    return 0 if done.within else DRIFT_EXIT


def health(args: argparse.Namespace) -> int:
    from api.routes.health import health_body

    body = asyncio.run(health_body())
    print(json.dumps(body, indent=2))
    return 0 if body["status"] == "ok" else 1


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ceiling", description=__doc__)
    sub = p.add_subparsers(required=True)
    s = sub.add_parser("serve", help="serve the API (uvicorn, one worker)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.set_defaults(func=serve)
    b = sub.add_parser("budgets").add_subparsers(required=True)
    bs = b.add_parser("set", help="create or replace a budget")
    bs.add_argument("budget_id")
    bs.add_argument("--limit", type=_limit, action="append", required=True,
                    help="PERIOD=AMOUNT, e.g. day=$5.00 or total=1000000 (repeatable)")
    bs.add_argument("--timezone", default="UTC")
    bs.add_argument("--allowance", type=_amount, default=0, help="outage allowance")
    bs.add_argument("--outage-policy", choices=[p.value for p in OutagePolicy], default=None,
                    help="while the ledger is unreachable: closed (refuse), allowance (admit "
                         "up to --allowance per instance), open (admit, journal, book later)")
    bs.add_argument("--model", action="append", default=None,
                    help="a model its calls may name (models.allow; repeatable): any other is "
                         "refused")
    bs.add_argument("--model-limit", type=_model_limit, action="append", default=None,
                    help="MODEL:PERIOD=AMOUNT, a limit of its calls of one model (per_model; "
                         "repeatable), e.g. gpt-5:day=$50")
    bs.set_defaults(func=budgets_set)
    bl = b.add_parser("list", help="budgets in id order, a page at a time")
    bl.add_argument("--prefix", default=None)
    bl.add_argument("--cursor", default=None, help="next_cursor of the previous page")
    bl.add_argument("--limit", type=int, default=None)
    bl.set_defaults(func=budgets_list)
    bd = b.add_parser("delete", help="delete a budget (refused while reservations hold money "
                                     "in it, unless --force charges them as unknown)")
    bd.add_argument("budget_id")
    bd.add_argument("--force", action="store_true")
    bd.set_defaults(func=budgets_delete)
    bw = b.add_parser("show")
    bw.add_argument("budget_id")
    bw.set_defaults(func=budgets_show)
    bus = b.add_parser("users", help="a budget's end users in id order, each with its spend, a "
                       "page at a time")
    bus.add_argument("budget_id")
    bus.add_argument("--cursor")
    bus.add_argument("--limit", type=int)
    bus.set_defaults(func=budgets_users)
    bu = b.add_parser("resume", help="lift the pause a velocity alarm put on a budget")
    bu.add_argument("budget_id")
    bu.set_defaults(func=budgets_resume)
    a = sub.add_parser("alerts").add_subparsers(required=True)
    a.add_parser("list", help="the alert log, newest first, with delivery").set_defaults(
        func=alerts_list)
    a.add_parser("deliver", help="one delivery pass (what a scheduler triggers)").set_defaults(
        func=alerts_deliver)
    k = sub.add_parser("keys").add_subparsers(required=True)
    kc = k.add_parser("create", help="create an API key (printed once)")
    kc.add_argument("budget_id")
    kc.add_argument("--run-ceiling", type=_amount, default=None)
    kc.add_argument("--role", action="append", choices=[r.value for r in Role], type=Role,
                    help="gateway (the default) or sidecar; repeat for both")
    kc.set_defaults(func=keys_create)
    kr = k.add_parser("revoke")
    kr.add_argument("key_id")
    kr.set_defaults(func=keys_revoke)
    kl = k.add_parser("list", help="key ids, roles, created, last used; never secrets")
    kl.add_argument("--budget-id", default=None)
    kl.add_argument("--cursor", default=None)
    kl.add_argument("--limit", type=int, default=None)
    kl.set_defaults(func=keys_list)
    ko = k.add_parser("rotate", help="a new secret (printed once); the old one works for the "
                                     "grace period")
    ko.add_argument("key_id")
    ko.add_argument("--grace-s", type=int, default=None,
                    help="seconds the old secret keeps working (default a day, at most 7 days)")
    ko.set_defaults(func=keys_rotate)
    au = sub.add_parser("audit", help="admin changes, newest first")
    au.add_argument("--cursor", default=None)
    au.add_argument("--limit", type=int, default=None)
    au.set_defaults(func=audit_list)
    lg = sub.add_parser("ledger").add_subparsers(required=True)
    le = lg.add_parser("export", help="write the ledger to FILE ('-': stdout) as one document")
    le.add_argument("file")
    le.set_defaults(func=ledger_export)
    lr = lg.add_parser("restore", help="restore an export into an empty or wiped ledger")
    lr.add_argument("file")
    lr.add_argument("--book-from-bill", default=None, metavar="BILL.json",
                    help="a provider's bill (core/operations.py BILL_FORMAT): what it shows "
                         "beyond the export is booked")
    lr.add_argument("--force", action="store_true",
                    help="restore over a ledger that has data: keeps the larger committed spend")
    lr.set_defaults(func=ledger_restore)
    la = lg.add_parser("adopt", help="confirm the restored ledger: running instances serve it")
    la.set_defaults(func=ledger_adopt)
    lm = lg.add_parser("migrate", help="bring a ledger of an earlier format to this version's "
                       "(once, before this version serves it); safe to run again")
    lm.add_argument("--dry-run", action="store_true", help="count what would change; write "
                    "nothing")
    lm.set_defaults(func=ledger_migrate)
    r = sub.add_parser("reservations").add_subparsers(required=True)
    rs = r.add_parser("settle", help="correct a reservation's charge (an operator's settle)")
    rs.add_argument("reservation_id")
    rs.add_argument("--actual", type=_amount, required=True,
                    help="what the provider billed for the call: micro-dollars or $1.00")
    rs.add_argument("--reason", required=True, help="why, recorded on the reservation")
    rs.set_defaults(func=reservations_settle)
    rw = r.add_parser("show", help="a reservation as stored, with its correction")
    rw.add_argument("reservation_id")
    rw.set_defaults(func=reservations_show)
    rc = sub.add_parser("reconcile", help="compare the ledger's gateway spend per UTC day with "
                        "a provider's cost report; exit 0 within the tolerance, 3 beyond it")
    rc.add_argument("provider", choices=[str(provider) for provider in COST_REPORTS])
    rc.add_argument("--from", dest="first", default=None, metavar="YYYY-MM-DD",
                    help="the first UTC day (default: a week before --to)")
    rc.add_argument("--to", dest="last", default=None, metavar="YYYY-MM-DD",
                    help="the last UTC day (default: yesterday)")
    rc.add_argument("--tolerance-pct", default=None, metavar="P",
                    help="the drift a day may have, percent of the larger side (default 1)")
    rc.add_argument("--json", action="store_true", help="print the document the admin route "
                    "answers instead of the table")
    rc.add_argument("--book-into", default=None, metavar="BUDGET_ID",
                    help="book each day's spend the provider billed beyond what the ledger saw "
                    "(beyond the tolerance) into this budget as committed spend, once per day")
    rc.set_defaults(func=reconcile)
    h = sub.add_parser("health", help="print health; exit 0 only when ok")
    h.set_defaults(func=health)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
