"""A fleet on loopback: N service instances as N OS processes, one Redis, one stub provider.

Each instance is `ceiling serve` in its own process with its own memory, as each serverless
instance is. In `shared` mode every instance is given REDIS_URL; in `memory` mode each runs the
per-instance ledger (CEILING_SINGLE_REPLICA=1), so the fleet holds N ceilings instead of one.
Every instance's gateway forwards Anthropic's Messages API to the stub (CEILING_ANTHROPIC_URL),
or with `upstreams` routes it and Google's Gemini API to the stub by CEILING_UPSTREAMS.
The provider's bill (infra.stub_provider) is the witness of what was spent.

`run_load` drives a fleet with a Locust scenario (locustfiles/ceiling.py) in a child process
and returns what it measured; the locust process's exit code says whether the ceiling held.

Everything listens on 127.0.0.1 and is stopped by pid (the provider, a thread, by its server),
also when start-up fails or the caller is interrupted.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from core.money import usd_to_micros
from infra.processes import tls_context
from infra.redis_server import RedisServer
from infra.service import ServiceProcess
from infra.stub_provider import StubProvider, reset_bill

# The requirement, and the production incident's shape: 25 instances, 25 workers.
INSTANCES = 25
# Variables that pick a ledger or a price list; the fleet sets them itself, so an operator's
# shell (a REDIS_URL exported for something else) cannot turn the memory fleet into a shared one.
LEDGER_ENV = ("REDIS_URL", "REDIS_CLUSTER", "UPSTASH_REDIS_REST_URL", "UPSTASH_REDIS_REST_TOKEN",
              "KV_REST_API_URL", "KV_REST_API_TOKEN", "CEILING_SINGLE_REPLICA",
              "CEILING_PRICES_FILE")
ADMIN_CALL_TIMEOUT_S = 10.0
STARTS_PER_CPU = 2
LOCUSTFILE = Path(__file__).resolve().parent.parent / "locustfiles" / "ceiling.py"
# Locust waits this long for a worker to finish the call it is in when the run is stopped, so
# a stopped run leaves no call billed and unsettled; a call takes well under a second.
LOCUST_STOP_TIMEOUT_S = 10
# Locust itself starts in a second or two; past this margin the child is killed by pid.
LOCUST_START_MARGIN_S = 30


class LedgerMode(StrEnum):
    SHARED = "shared"
    MEMORY = "memory"


@dataclass(frozen=True)
class Workload:
    """One Locust scenario: what every worker calls, and the ceiling it calls against.

    Workers call until the ledger refuses with budget_exceeded, so a run ends on its own once
    the ceiling (or, in memory mode, every instance's copy of it) is spent.
    """

    user_class: str
    ceiling_micros: int
    model: str
    max_output_tokens: int
    prompt: str
    stream: bool
    # A worker stops after this many calls even if nothing refuses it: bounds a broken run.
    calls_per_worker_max: int
    run_time_s: int
    # None: workers reserve, call the provider themselves and settle (sidecar keys); a gateway
    # route: workers call the provider through it (gateway keys), streaming every other call
    # when `stream`.
    gateway_route: str | None = None
    # Gemini's thinkingBudget: thinking tokens are billed as output beside the cap, and the
    # gateway holds them on top of it; 0 for a scenario whose model does not think.
    thinking_budget_tokens: int = 0


# A budget with room for a handful of calls: four worst cases at once ($0.0101 each: gpt-4o,
# 1,000 output tokens), about fifteen at realistic lengths. The seed incident's $0.05 ceiling.
HANDFUL = Workload(
    user_class="HandfulOfCalls", ceiling_micros=usd_to_micros("0.05"), model="gpt-4o",
    max_output_tokens=1_000, prompt="Summarise this support ticket in two sentences.",
    stream=False, calls_per_worker_max=100, run_time_s=60,
)
# A larger budget pushed to exhaustion with streamed answers of realistic length (the stub's
# mean is a quarter of the cap): a few hundred calls.
EXHAUSTION = Workload(
    user_class="ToExhaustion", ceiling_micros=usd_to_micros("1.00"), model="gpt-4o",
    max_output_tokens=1_000, prompt="Draft a reply to this customer and list the next steps.",
    stream=True, calls_per_worker_max=100, run_time_s=90,
)
# Anthropic's Messages API through the gateway, its wire format as the anthropic SDK sends it:
# the same $0.05 ceiling, claude-haiku-4-5 (a worst case of ~$0.0056: 1,000 output tokens at $5
# a million), every other call streamed.
MESSAGES = Workload(
    user_class="MessagesThroughGateway", ceiling_micros=usd_to_micros("0.05"),
    model="claude-haiku-4-5", max_output_tokens=1_000,
    prompt="Summarise this support ticket in two sentences.", stream=True,
    calls_per_worker_max=100, run_time_s=60, gateway_route="/v1/messages",
)
# Google's Gemini API through the gateway (generateContent, the key in x-goog-api-key), routed by
# CEILING_UPSTREAMS to a `gemini` upstream at the stub: the same $0.05 ceiling, gemini-2.5-flash
# (a worst case of ~$0.0030: 1,000 output and 200 thinking tokens at $2.50 a million), every
# call answered whole (a Gemini stream ends on Google's last event: no trailer with its charge).
GEMINI = Workload(
    user_class="GeminiThroughGateway", ceiling_micros=usd_to_micros("0.05"),
    model="gemini-2.5-flash", max_output_tokens=1_000,
    prompt="Summarise this support ticket in two sentences.", stream=False,
    calls_per_worker_max=100, run_time_s=60,
    gateway_route="/v1beta/models/gemini-2.5-flash:generateContent", thinking_budget_tokens=200,
)
WORKLOADS = {w.user_class: w for w in (HANDFUL, EXHAUSTION, MESSAGES, GEMINI)}
# The key the instances send the stub as each upstream's; the stub checks none (StubProvider's
# api_key None), so any value serves, named only because an upstream reads its key from the env.
STUB_KEY_ENV = "CEILING_STUB_KEY"


def stub_upstreams(provider_url: str) -> dict[str, Any]:
    """CEILING_UPSTREAMS for a fleet whose gateway routes by named upstreams, all at the stub: the
    Messages scenario's model at an `anthropic` upstream, the Gemini scenario's at a `gemini` one.
    A model neither names is refused, so a fleet with them runs no chat-completions scenario."""
    return {"upstreams": [
        {"name": "anthropic", "api": "anthropic", "base_url": provider_url,
         "api_key_env": STUB_KEY_ENV, "models": [MESSAGES.model]},
        {"name": "google", "api": "gemini", "base_url": provider_url,
         "api_key_env": STUB_KEY_ENV, "models": [GEMINI.model]},
    ]}


@dataclass(frozen=True)
class LoadPlan:
    """What the locust process is given (as a JSON file): where to call, with which keys."""

    user_class: str
    instance_urls: list[str]
    api_keys: list[str]
    provider_url: str
    budget_id: str
    ceiling_micros: int
    result_path: str

    @property
    def workload(self) -> Workload:
        return WORKLOADS[self.user_class]

    def write(self, path: Path) -> None:
        # It holds API keys; it is written only into the fleet's workdir, which mkdtemp makes
        # readable by its owner alone.
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def read(cls, path: str) -> LoadPlan:
        return cls(**json.loads(Path(path).read_text()))


@dataclass
class LoadResult:
    """What one locust run measured. Money is what the provider billed, not what the ledger says.

    `finished` is true when every worker stopped because the ledger refused it, so no call was
    cut short and every billed call was settled.
    """

    user_class: str
    budget_id: str
    workers: int
    ceiling_micros: int
    billed_micros: int
    billed_calls: int
    admitted: int
    settled: int
    charged_micros: int
    refused_exceeded: int
    busy_waits: int
    errors: int
    finished: bool
    calls_by_instance: list[int]
    billed_at_first_refusal_micros: int | None
    exit_code: int = -1

    @property
    def overrun_micros(self) -> int:
        return max(0, self.billed_micros - self.ceiling_micros)

    @property
    def overrun_pct(self) -> float:
        return self.overrun_micros * 100 / self.ceiling_micros

    @property
    def utilization_pct(self) -> float:
        return self.billed_micros * 100 / self.ceiling_micros

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def read(cls, path: Path) -> LoadResult:
        return cls(**json.loads(path.read_text()))


@dataclass
class Fleet:
    """Start with `with Fleet(mode=...) as fleet:`; everything is stopped on the way out."""

    mode: LedgerMode = LedgerMode.SHARED
    instances: int = INSTANCES
    provider: StubProvider = field(default_factory=StubProvider)
    admin_token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="sc-fleet-")))
    redis: RedisServer = field(default_factory=lambda: RedisServer(durable=True))
    services: list[ServiceProcess] = field(default_factory=list)
    # Issue 16: where the instances post alert events (and the secret), or None for no webhook.
    alert_webhook_url: str | None = None
    alert_webhook_secret: str = field(default_factory=lambda: secrets.token_urlsafe(16))
    # Route the gateway by CEILING_UPSTREAMS (stub_upstreams: what the Gemini scenario needs)
    # instead of the one-upstream shorthand (CEILING_ANTHROPIC_URL).
    upstreams: bool = False
    # Wall time from the first instance's spawn until all answered /health/live.
    start_s: float = 0.0
    _http: httpx.Client | None = field(default=None, init=False, repr=False)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.services]

    @property
    def http(self) -> httpx.Client:
        if self._http is None:
            self._http = httpx.Client(timeout=ADMIN_CALL_TIMEOUT_S, verify=tls_context())
        return self._http

    def service_env(self) -> dict[str, str]:
        env = dict.fromkeys(LEDGER_ENV, "")
        env["CEILING_ADMIN_TOKEN"] = self.admin_token
        if self.mode is LedgerMode.SHARED:
            env["REDIS_URL"] = self.redis.url
        else:
            env["CEILING_SINGLE_REPLICA"] = "1"
        env["CEILING_ANTHROPIC_URL"] = self.provider.url
        if self.upstreams:
            path = self.workdir / "upstreams.json"
            path.write_text(json.dumps(stub_upstreams(self.provider.url)))
            env["CEILING_UPSTREAMS"] = str(path)
            env[STUB_KEY_ENV] = "stub-key"
        if self.alert_webhook_url:
            env["CEILING_ALERT_WEBHOOK_URL"] = self.alert_webhook_url
            env["CEILING_ALERT_WEBHOOK_SECRET"] = self.alert_webhook_secret
            env["CEILING_ALERT_DELIVERY_INTERVAL_S"] = "1"
        return env

    def start(self) -> Fleet:
        try:
            self.redis.start()
            self.provider.start()
            env = self.service_env()
            self.services = [
                ServiceProcess(env=env, log_path=str(self.workdir / f"instance-{i:02d}.log"))
                for i in range(self.instances)
            ]
            started = time.monotonic()
            # An instance spends CPU on imports and its first connection before it answers.
            # Starting all at once on a small machine makes each of them slow, past
            # ServiceProcess's timeout; two starts per core keep the cores busy and each start
            # short. On an error or Ctrl-C, starts not yet begun are cancelled.
            pool = ThreadPoolExecutor(STARTS_PER_CPU * (os.cpu_count() or 1))
            try:
                for _ in pool.map(ServiceProcess.start, self.services):
                    pass
            finally:
                pool.shutdown(wait=True, cancel_futures=True)
            self.start_s = time.monotonic() - started
        except BaseException as exc:
            self.stop(keep_logs=not isinstance(exc, KeyboardInterrupt))
            raise
        return self

    def stop(self, *, keep_logs: bool = False) -> None:
        """Stop every process this fleet started, by pid; keep the logs when something failed."""
        if self._http is not None:
            self._http.close()
            self._http = None
        with ThreadPoolExecutor(max(1, len(self.services))) as pool:
            for _ in pool.map(ServiceProcess.stop, self.services):
                pass
        self.provider.stop()
        self.redis.stop()
        shutil.rmtree(self.redis.workdir, ignore_errors=True)
        if keep_logs:
            print(f"fleet: instance logs kept in {self.workdir}", file=sys.stderr)
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop(keep_logs=et is not None and not issubclass(et, KeyboardInterrupt))

    # -- admin ---------------------------------------------------------------------------

    def _admin(self, method: str, url: str, body: dict[str, Any] | None = None) -> Any:
        response = self.http.request(
            method, url, json=body, headers={"Authorization": f"Bearer {self.admin_token}"}
        )
        if response.status_code >= 300:
            raise RuntimeError(f"{method} {url}: {response.status_code} {response.text}")
        return response.json()

    def provision(self, budget_id: str, ceiling_micros: int, role: str = "sidecar") -> list[str]:
        """Create a `total` budget and return the API key worker i uses on instance i.

        Shared mode: one budget and one key in the one ledger, valid on every instance. Memory
        mode: each instance holds its own budgets and keys, so each gets the budget (the same
        ceiling, as every replica of one deployment would be configured) and a key of its own.
        Keys have `role`: sidecar for workers that reserve and settle themselves, gateway for
        workers that call through the gateway.
        """
        targets = self.urls if self.mode is LedgerMode.MEMORY else self.urls[:1]
        budget = {"limits": [{"period": "total", "ceiling_micros": ceiling_micros}],
                  "timezone": "UTC", "outage_allowance_micros": 0}
        keys = []
        for url in targets:
            self._admin("PUT", f"{url}/v1/admin/budgets/{budget_id}", budget)
            created = self._admin("POST", f"{url}/v1/admin/keys", {
                "budget_id": budget_id, "run_ceiling_micros": None, "roles": [role]})
            keys.append(str(created["api_key"]))
        return keys * (self.instances // len(keys))

    def committed_micros(self, budget_id: str) -> list[int]:
        """Each instance's answer to "how much has this budget spent" (its `total` period)."""
        answers = []
        for url in self.urls:
            doc = self._admin("GET", f"{url}/v1/admin/budgets/{budget_id}")
            (total,) = [p for p in doc["periods"] if p["period"] == "total"]
            answers.append(int(total["committed_micros"]))
        return answers

    def health(self) -> list[dict[str, Any]]:
        """Every instance's /health body, as its operator reads it (the admin token: ids and
        the ledger's details); a 503 is an answer too (degraded is not an error)."""
        auth = {"Authorization": f"Bearer {self.admin_token}"}
        return [self.http.get(f"{url}/health", headers=auth).json() for url in self.urls]

    # -- load ----------------------------------------------------------------------------

    def run_load(self, workload: Workload, budget_id: str | None = None) -> LoadResult:
        """Provision a fresh budget, run the workload's Locust scenario against it, and return
        what it measured; `exit_code` is locust's (0 only when the ceiling held and the run was
        clean). The provider's bill is reset first, so the bill is this run's alone."""
        budget_id = budget_id or f"org:proof-{secrets.token_hex(4)}"
        keys = self.provision(budget_id, workload.ceiling_micros,
                              "gateway" if workload.gateway_route else "sidecar")
        reset_bill(self.provider.url)
        run_dir = Path(tempfile.mkdtemp(prefix="load-", dir=self.workdir))
        plan = LoadPlan(
            user_class=workload.user_class, instance_urls=self.urls, api_keys=keys,
            provider_url=self.provider.url, budget_id=budget_id,
            ceiling_micros=workload.ceiling_micros, result_path=str(run_dir / "result.json"),
        )
        plan_path = run_dir / "plan.json"
        plan.write(plan_path)
        command = [
            sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), workload.user_class,
            "--headless", "-u", str(self.instances), "-r", str(self.instances),
            "--run-time", f"{workload.run_time_s}s", "--stop-timeout", str(LOCUST_STOP_TIMEOUT_S),
            "--host", self.provider.url, "--only-summary", "--loglevel", "WARNING",
            "--plan", str(plan_path),
        ]
        with open(run_dir / "locust.log", "wb") as log:
            completed = subprocess.run(
                command, stdout=log, stderr=subprocess.STDOUT, check=False,
                timeout=workload.run_time_s + LOCUST_STOP_TIMEOUT_S + LOCUST_START_MARGIN_S,
            )
        result_path = Path(plan.result_path)
        if not result_path.exists():
            raise RuntimeError(f"locust wrote no result (exit {completed.returncode}); see "
                               f"{run_dir / 'locust.log'} and {plan_path}")
        result = LoadResult.read(result_path)
        result.exit_code = completed.returncode
        return result
