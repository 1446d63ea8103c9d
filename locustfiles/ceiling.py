"""Locust scenarios: many workers, many instances, one ceiling, judged by the provider's bill.

Worker i calls instance i (round-robin) with its key. A sidecar worker prices and reserves the
worst case (POST /v1/reservations with the chat messages and the output cap), calls the stub
provider, and settles with the provider's usage; a gateway worker calls the provider through
the instance's gateway, which does all three. A worker stops when the ledger refuses it with
402 budget_exceeded; a 429 budget_busy is waited out (Retry-After) and retried. When every
worker has stopped, the run ends on its own; --run-time only bounds a broken one.

    HandfulOfCalls          a budget with room for a handful of calls (infra.fleet.HANDFUL)
    ToExhaustion            a larger budget spent to exhaustion with streamed answers of
                            realistic length; also reports utilization (infra.fleet.EXHAUSTION)
    MessagesThroughGateway  Anthropic's Messages API through the gateway, in the wire format the
                            anthropic SDK sends, every other call streamed (infra.fleet.MESSAGES)
    GeminiThroughGateway    Google's Gemini API through the gateway (generateContent, the key in
                            x-goog-api-key), a thinking budget beside the output cap: the fleet
                            routes it by CEILING_UPSTREAMS (infra.fleet.GEMINI)
    EndUsersThroughGateway  100 end users behind one key whose budget holds each of them to
                            per_user limits (END_USERS below): chat completions through the
                            gateway, each call naming its user in the body (`user`, or
                            `safety_identifier`), every other call streamed

On stop it reads the provider's bill (GET /billing), writes infra.fleet.LoadResult to the plan's
result path, prints the overrun and sets the exit code: 0 the ceiling held and the run was
clean; 1 the provider billed more than the ceiling (or, for end users, more than one user's
ceiling); 2 the run itself failed (an unexpected answer, or a worker still calling at
--run-time). Run it through infra.fleet.Fleet.run_load, which writes the plan (--plan) for the
fleet it started.

The end users' scenario needs a fleet that prices each end user's model on both sides and gives
the plan's budget its per_user limits (tests/test_proof.py ProofFleet). The stub's bill names no
end user, so each end user calls a model of its own (`user_model`), priced alike on both sides,
and the bill's tally per model is the bill per end user.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gevent
import httpx
from locust import HttpUser, constant, events, task
from locust.env import Environment

from core.money import micros_to_usd
from infra.fleet import EXHAUSTION, GEMINI, HANDFUL, MESSAGES, LoadPlan, LoadResult, Workload
from infra.stub_provider import Bill, fetch_bill

# The Messages API version the anthropic SDK sends as anthropic-version.
ANTHROPIC_VERSION = "2023-06-01"
EXIT_HELD = 0
EXIT_OVERRUN = 1
EXIT_BROKEN = 2

# -- end users ---------------------------------------------------------------------------------
# 100 end users share the plan's one key (one per instance, of one budget). Each user's calls
# name it in the body, `user` for even users and `safety_identifier` for odd ones, and call a
# model of the user's own (`user_model`), which is how the provider's bill tells the users apart.
END_USERS_COUNT = 100
END_USER_MODEL_PREFIX = "hx-user-"
END_USERS = Workload(
    user_class="EndUsersThroughGateway", ceiling_micros=250_000, model=END_USER_MODEL_PREFIX,
    max_output_tokens=1_000, prompt="Answer this end user's question in two sentences.",
    stream=True, calls_per_worker_max=100, run_time_s=90, gateway_route="/v1/chat/completions",
)
BUDGETS_READ_TIMEOUT_S = 10.0


def end_user(index: int) -> str:
    return f"user-{index:03d}@example.com"


def user_model(index: int) -> str:
    return f"{END_USER_MODEL_PREFIX}{index:03d}"


@dataclass
class Run:
    """What the workers of this locust process did; one process, so plain counters suffice."""

    plan: LoadPlan
    worker_ids: itertools.count[int] = field(default_factory=itertools.count)
    admitted: int = 0
    settled: int = 0
    charged_micros: int = 0
    refused_exceeded: int = 0
    busy_waits: int = 0
    errors: int = 0
    workers_stopped: int = 0
    workers_refused: int = 0
    calls_by_instance: list[int] = field(default_factory=list)
    billed_at_first_refusal_micros: int | None = None
    # End users: those their own ceiling refused (no worker calls for them again), and the busy
    # answers of a user's budget (the worker calls for another user instead of waiting).
    users_refused: set[int] = field(default_factory=set)
    user_busy_skips: int = 0


RUN: Run | None = None


def run_state() -> Run:
    if RUN is None:
        raise RuntimeError("no plan: run this locustfile through infra.fleet (--plan PATH)")
    return RUN


# locust's add_listener is untyped, which mypy --strict reports on each of its decorators.
@events.init_command_line_parser.add_listener  # type: ignore[untyped-decorator]
def add_arguments(parser: Any) -> None:
    parser.add_argument("--plan", default="", help="the fleet's plan (JSON), from infra.fleet")


@events.init.add_listener  # type: ignore[untyped-decorator]
def load_plan(environment: Environment, **_: Any) -> None:
    global RUN
    options = environment.parsed_options
    if options is not None and options.plan:
        plan = LoadPlan.read(options.plan)
        RUN = Run(plan, calls_by_instance=[0] * len(plan.instance_urls))


@events.test_stop.add_listener  # type: ignore[untyped-decorator]
def judge(environment: Environment, **_: Any) -> None:
    run = run_state()
    bill = fetch_bill(run.plan.provider_url)
    options = environment.parsed_options
    workers = int(options.num_users) if options is not None else 0
    result = LoadResult(
        user_class=run.plan.user_class, budget_id=run.plan.budget_id, workers=workers,
        ceiling_micros=run.plan.ceiling_micros, billed_micros=bill.total.cost_micros,
        billed_calls=bill.total.calls, admitted=run.admitted, settled=run.settled,
        charged_micros=run.charged_micros, refused_exceeded=run.refused_exceeded,
        busy_waits=run.busy_waits, errors=run.errors,
        finished=run.workers_refused == workers and run.errors == 0,
        calls_by_instance=run.calls_by_instance,
        billed_at_first_refusal_micros=run.billed_at_first_refusal_micros,
    )
    users_over, users_limited = (judge_end_users(run, bill)
                                 if run.plan.user_class == END_USERS.user_class else ([], True))
    if result.overrun_micros > 0 or users_over:
        result.exit_code = EXIT_OVERRUN
    elif not result.finished or not users_limited:
        result.exit_code = EXIT_BROKEN
    else:
        result.exit_code = EXIT_HELD
    Path(run.plan.result_path).write_text(json.dumps(result.to_json()))
    print(
        f"{result.user_class}: ceiling ${micros_to_usd(result.ceiling_micros)}, the provider "
        f"billed ${micros_to_usd(result.billed_micros)} for {result.billed_calls} calls: "
        f"overrun {result.overrun_pct:.1f}%, utilization {result.utilization_pct:.1f}%; "
        f"{result.refused_exceeded} refusals, {result.busy_waits} busy waits, "
        f"{result.errors} errors, finished={result.finished}"
    )
    environment.process_exit_code = result.exit_code


def judge_end_users(run: Run, bill: Bill) -> tuple[list[str], bool]:
    """The end users the provider billed more than their own ceiling, which the ledger says (GET
    /v1/budgets/me for that user: the per_user limits of the plan's budget); and whether every
    user had one (a budget without per_user limits is a broken run, not a held one)."""
    over = []
    url = f"{run.plan.instance_urls[0]}/v1/budgets/me"
    billed_users = 0
    limited = True
    with httpx.Client(timeout=BUDGETS_READ_TIMEOUT_S) as http:
        for index in range(END_USERS_COUNT):
            user = end_user(index)
            r = http.get(url, headers={"Authorization": f"Bearer {run.plan.api_keys[0]}",
                                       "X-Ceiling-User": user})
            r.raise_for_status()
            ceilings = [leg["ceiling_micros"] for leg in r.json()["budgets"]
                        if leg["budget_id"] == f"{run.plan.budget_id}/user:{user}"
                        and leg["period"] == "total"]
            tally = bill.by_model.get(user_model(index))
            billed = tally.cost_micros if tally else 0
            billed_users += billed > 0
            if len(ceilings) != 1:
                limited = False
            elif billed > ceilings[0]:
                over.append(f"{user}: billed {billed} > {ceilings[0]}")
    print(f"{END_USERS.user_class}: {billed_users} of {END_USERS_COUNT} end users billed, "
          f"{len(run.users_refused)} refused by their own ceiling, {run.user_busy_skips} busy "
          f"skips; users over their ceiling: {over or 'none'}"
          + ("" if limited else "; the budget holds no per_user total limit"))
    return over, limited


class Worker(HttpUser):
    """What every worker of a scenario has: its instance, its key, and how it stops."""

    abstract = True
    wait_time = constant(0)
    workload: Workload

    def on_start(self) -> None:
        run = run_state()
        self.worker = next(run.worker_ids)
        self.instance = self.worker % len(run.plan.instance_urls)
        self.service_url = run.plan.instance_urls[self.instance]
        self.api_key = run.plan.api_keys[self.instance]
        self.auth = {"Authorization": f"Bearer {self.api_key}"}
        self.calls = 0
        self.finished = False

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"{self.workload.prompt} (worker {self.worker}, "
                                            f"call {self.calls})"}]

    def refused(self, r: Any) -> bool:
        """Whether the ledger said no (the answer is then accounted for): 402 budget_exceeded
        stops the worker, 429 budget_busy waits until open reservations should have settled."""
        run = run_state()
        code = _error_code(r)
        # Google's error shape carries budget_exceeded as a 400 FAILED_PRECONDITION.
        if r.status_code in (402, 400) and code == "budget_exceeded":
            r.success()
            run.refused_exceeded += 1
            # Utilization when refusals began: the provider's bill at the first refusal.
            if run.billed_at_first_refusal_micros is None:
                run.billed_at_first_refusal_micros = (
                    fetch_bill(run.plan.provider_url).total.cost_micros
                )
            self.finish(refused=True)
            return True
        if r.status_code == 429 and code == "budget_busy":
            r.success()
            run.busy_waits += 1
            # Retry-After says when open reservations should have settled; the worker holds
            # nothing while it waits.
            gevent.sleep(float(r.headers.get("Retry-After", "1")))
            return True
        return False

    def through_gateway(self, body: dict[str, Any], headers: dict[str, str], *, stream: bool,
                        name: str | None = None,
                        refused: Callable[[Any], bool] = lambda r: False) -> None:
        """One call through the instance's gateway route, counted when its answer says what it
        was charged; `refused`: a refusal of the worker's own to read before the ledger's."""
        url = f"{self.service_url}{self.workload.gateway_route}"
        with self.client.post(url, json=body, headers=headers, stream=stream,
                              name=name or ("gateway: stream" if stream else "gateway"),
                              catch_response=True) as r:
            if r.status_code == 200:
                if _billed(r, stream, self.instance):
                    self.calls += 1
                    return
            elif refused(r) or self.refused(r):
                return
            else:
                r.failure(f"gateway: {r.status_code} {r.text[:200]}")
        self.count_error()

    def count_error(self) -> None:
        run_state().errors += 1
        self.finish(refused=False)

    def finish(self, *, refused: bool) -> None:
        """Stop this worker after its current call; the last one to stop ends the run."""
        if self.finished:  # a failed release after a failed call: one stop, counted once
            return
        self.finished = True
        run = run_state()
        run.workers_stopped += 1
        run.workers_refused += refused
        self.stop()
        options = self.environment.parsed_options
        runner = self.environment.runner
        if options is not None and runner is not None and run.workers_stopped == options.num_users:
            gevent.spawn(runner.quit)


class CeilingWorker(Worker):
    """A sidecar worker: reserve -> call the provider -> settle, until the ledger says no."""

    abstract = True

    @task
    def call(self) -> None:
        if self.calls >= self.workload.calls_per_worker_max:
            self.finish(refused=False)
            return
        messages = self.messages()
        reservation_id = self.reserve(messages)
        if reservation_id is None:
            return
        self.calls += 1
        usage = self.call_provider(messages)
        if usage is None:
            self.post_ledger(f"/v1/reservations/{reservation_id}/release", {}, "release")
            return
        settled = self.post_ledger(f"/v1/reservations/{reservation_id}/settle", {
            "input_tokens": usage["prompt_tokens"],
            "output_tokens": usage["completion_tokens"],
            "cached_input_tokens": usage["prompt_tokens_details"]["cached_tokens"],
        }, "settle")
        if settled is not None:
            run = run_state()
            run.settled += 1
            run.charged_micros += int(settled["charged_micros"])

    def reserve(self, messages: list[dict[str, str]]) -> str | None:
        """The reservation's id; None when the worker must wait (busy) or has stopped."""
        run = run_state()
        body = {"model": self.workload.model, "messages": messages,
                "max_output_tokens": self.workload.max_output_tokens}
        with self.client.post(f"{self.service_url}/v1/reservations", json=body,
                              headers=self.auth, name="reserve", catch_response=True) as r:
            if r.status_code == 201:
                r.success()
                run.admitted += 1
                run.calls_by_instance[self.instance] += 1
                return str(r.json()["reservation_id"])
            if self.refused(r):
                return None
            r.failure(f"reserve: {r.status_code} {r.text[:200]}")
        self.count_error()
        return None

    def call_provider(self, messages: list[dict[str, str]]) -> dict[str, Any] | None:
        provider_url = run_state().plan.provider_url
        body: dict[str, Any] = {"model": self.workload.model, "messages": messages,
                                "max_tokens": self.workload.max_output_tokens}
        if self.workload.stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        with self.client.post(f"{provider_url}/v1/chat/completions", json=body,
                              name="provider: chat", catch_response=True,
                              stream=self.workload.stream) as r:
            if r.status_code == 200:
                usage = _stream_usage(r.iter_lines()) if self.workload.stream else r.json()["usage"]
                if usage is not None:
                    return dict(usage)
                r.failure("the stream carried no usage chunk")
            else:
                r.failure(f"provider: {r.status_code} {r.text[:200]}")
        self.count_error()
        return None

    def post_ledger(self, path: str, body: dict[str, Any], name: str) -> dict[str, Any] | None:
        with self.client.post(f"{self.service_url}{path}", json=body, headers=self.auth,
                              name=name, catch_response=True) as r:
            if r.status_code == 200:
                return dict(r.json())
            r.failure(f"{name}: {r.status_code} {r.text[:200]}")
        self.count_error()
        return None


class GatewayWorker(Worker):
    """A gateway worker: one call through the instance's gateway route, which prices, reserves,
    forwards and settles, until the ledger says no. The call's charge is in its answer's
    headers, or for a stream in the `: x-ceiling-...` lines after its last event."""

    abstract = True

    @task
    def call(self) -> None:
        if self.calls >= self.workload.calls_per_worker_max:
            self.finish(refused=False)
            return
        stream = self.workload.stream and self.calls % 2 == 1
        body = {"model": self.workload.model, "max_tokens": self.workload.max_output_tokens,
                "messages": self.messages(), "stream": stream}
        self.through_gateway(body, {"x-api-key": self.api_key,
                                    "anthropic-version": ANTHROPIC_VERSION}, stream=stream)


class GeminiWorker(Worker):
    """A gateway worker speaking Google's Gemini API: generateContent on the model's path, the
    key in x-goog-api-key, an output cap and a thinking budget, until the ledger says no."""

    abstract = True

    @task
    def call(self) -> None:
        if self.calls >= self.workload.calls_per_worker_max:
            self.finish(refused=False)
            return
        body = {"contents": [{"role": "user", "parts": [{"text": m["content"]}]}
                             for m in self.messages()],
                "generationConfig": {
                    "maxOutputTokens": self.workload.max_output_tokens,
                    "thinkingConfig": {"thinkingBudget": self.workload.thinking_budget_tokens}}}
        self.through_gateway(body, {"x-goog-api-key": self.api_key}, stream=False,
                             name="gateway: gemini")


class EndUserWorker(Worker):
    """A gateway worker calling for many end users behind the one key: first one call for each
    of its own users (so every user calls), then users drawn with weights 1/(index+1) (user 0 is
    called most: its ceiling binds first, under calls from many workers at once). A 402 naming a
    user's budget retires that user for every worker; a 402 naming the key's stops the worker,
    as do all the users being retired."""

    abstract = True

    def on_start(self) -> None:
        super().on_start()
        options = self.environment.parsed_options
        workers = int(options.num_users) if options is not None else 1
        self.own_users = [u for u in range(END_USERS_COUNT) if u % workers == self.worker]
        self.rng = random.Random(self.worker)

    def pick_user(self) -> int | None:
        refused = run_state().users_refused
        while self.own_users:
            user = self.own_users.pop(0)
            if user not in refused:
                return user
        left = [u for u in range(END_USERS_COUNT) if u not in refused]
        if not left:
            return None
        return self.rng.choices(left, weights=[1 / (u + 1) for u in left])[0]

    @task
    def call(self) -> None:
        if self.calls >= self.workload.calls_per_worker_max:
            self.finish(refused=False)
            return
        user = self.pick_user()
        if user is None:  # every user's own ceiling refused it: the ledger said no
            self.finish(refused=True)
            return
        stream = self.workload.stream and self.calls % 2 == 1
        body = {"model": user_model(user), "max_tokens": self.workload.max_output_tokens,
                "messages": self.messages(), "stream": stream,
                "safety_identifier" if user % 2 else "user": end_user(user)}
        self.through_gateway(body, self.auth, stream=stream,
                             refused=lambda r: self.users_own_refusal(r, user))

    def users_own_refusal(self, r: Any, user: int) -> bool:
        """Whether the user's own budget said no: spent (the user is retired) or busy (another
        user is called next); the answer is then accounted for."""
        run = run_state()
        if _error_field(r, "budget_id") != f"{run.plan.budget_id}/user:{end_user(user)}":
            return False
        code = _error_code(r)
        # Google's error shape carries budget_exceeded as a 400 FAILED_PRECONDITION.
        if r.status_code in (402, 400) and code == "budget_exceeded":
            run.users_refused.add(user)
        elif r.status_code == 429 and code == "budget_busy":
            run.user_busy_skips += 1
        else:
            return False
        r.success()
        return True


class HandfulOfCalls(CeilingWorker):
    workload = HANDFUL


class ToExhaustion(CeilingWorker):
    workload = EXHAUSTION


class MessagesThroughGateway(GatewayWorker):
    workload = MESSAGES


class GeminiThroughGateway(GeminiWorker):
    workload = GEMINI


class EndUsersThroughGateway(EndUserWorker):
    workload = END_USERS


def _error_code(response: Any) -> str | None:
    return _error_field(response, "code")


def _error_field(response: Any, name: str) -> str | None:
    """A field of the gateway's error; in Google's shape (the Gemini routes) its code is the
    first detail's (an ErrorInfo's) reason."""
    try:
        error = response.json()["error"]
        if "details" in error:
            return str(error["details"][0]["reason"]) if name == "code" else None
        return str(error[name])
    except (ValueError, KeyError, TypeError, IndexError):
        return None


def _billed(r: Any, stream: bool, instance: int) -> bool:
    """A gateway answer of 200, counted in the run when it says the call was billed (its figures
    in the stream's trailer or the headers); else marked a failure."""
    figures = _trailer(r.iter_lines()) if stream else r.headers
    if figures.get("x-ceiling-billing-outcome") != "billed":
        r.failure(f"gateway: outcome {figures.get('x-ceiling-billing-outcome')}")
        return False
    r.success()
    run = run_state()
    run.admitted += 1
    run.settled += 1
    run.calls_by_instance[instance] += 1
    run.charged_micros += int(figures["x-ceiling-charged-micros"])
    return True


def _trailer(lines: Any) -> dict[str, str]:
    """A gateway stream's figures, from the `: x-ceiling-...: value` lines it ends with."""
    figures = {}
    for raw in lines:
        line = raw.decode() if isinstance(raw, bytes) else raw
        if line.startswith(": x-ceiling-"):
            name, _, value = line[2:].partition(": ")
            figures[name] = value
    return figures


def _stream_usage(lines: Any) -> dict[str, Any] | None:
    """The usage of the last chunk that carries one (the include_usage chunk)."""
    usage = None
    for raw in lines:
        line = raw.decode() if isinstance(raw, bytes) else raw
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line.removeprefix("data: "))
            usage = chunk.get("usage") or usage
    return usage
