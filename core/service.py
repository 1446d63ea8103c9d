"""The reserve/settle service: price -> reserve -> (the caller calls the model) -> settle.

Everything the HTTP layer, the CLI and the gateway do with money goes through here, so input is
checked in one place: bad input raises InvalidRequest before the ledger is touched.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace

from core.budgets import (
    ALL_MODELS,
    UNLISTED_MODEL,
    BudgetDef,
    BudgetId,
    canonical_models,
    check_micros,
    check_user,
    is_model_name,
)
from core.content import NO_MEDIA, Media
from core.errors import (
    CeilingError,
    Forbidden,
    InvalidRequest,
    LedgerUnavailable,
    ReservationNotFound,
    Unauthorized,
    ensure,
)
from core.idempotency import fingerprint, key_digest
from core.ledger import (
    GATEWAY_OWNER_PREFIX,
    ROLES_DEFAULT,
    Correction,
    ExpirePolicy,
    KeyRecord,
    LegStatus,
    Release,
    Reservation,
    ReservationRef,
    ReservationView,
    ReserveRequest,
    Role,
    RunLimit,
    ServiceStore,
    Settlement,
    Upstream,
    bill_of_prices,
    mint_reservation_id,
    tag_digest_of,
)
from core.limits import (
    AMOUNT_MICROS_MAX,
    CEILING_MICROS_MAX,
    CORRECTION_REASON_LEN_MAX,
    IDEMPOTENCY_WINDOW_MS,
    REPLAY_WINDOW_MS,
    RESEND_WINDOW_MS,
    RESERVATION_ID_LEN_MAX,
    RESERVATION_TTL_MS_DEFAULT,
    RESERVATION_TTL_MS_MAX,
    RESERVATION_TTL_MS_MIN,
)
from core.outage import OutageAllowance
from core.prices import PriceTable, Usage

# Reservation ids: printable ASCII without separators the ledger uses.
_RESERVATION_ID = re.compile(rf"[A-Za-z0-9_.-]{{1,{RESERVATION_ID_LEN_MAX}}}")
_RUN_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
API_KEY_PREFIX = "sk-ceil-"
# A secret as this version mints it: the prefix, its key id, '-', then 256 random bits
# (token_urlsafe(32): 43 characters). The id in it is where authentication looks the key up: the
# key's one record decides, with no index of hashes to keep in step with it. The hex id ends at
# the '-', and the length tells it from a secret made before secrets carried their id (the
# prefix and 43 characters), which is found through the hash instead.
KEY_ID_HEX = 16  # a new key's id: 64 random bits
KEY_ID_HEX_MAX = 60  # any id an operator can name (core/operations.py check_key_id)
KEY_SECRET_BYTES = 32
KEY_SECRET_CHARS = 43  # base64 of KEY_SECRET_BYTES, unpadded
_NEW_API_KEY = re.compile(re.escape(API_KEY_PREFIX) + rf"(key_[0-9a-f]{{1,{KEY_ID_HEX_MAX}}})-"
                          rf"[A-Za-z0-9_-]{{{KEY_SECRET_CHARS}}}")
# Models of reservations this instance made, so a token-priced settle needs no extra read.
MODEL_CACHE_MAX = 50_000
# Keys this instance authenticated: trusted without a ledger read for KEY_TRUST_MS (one round
# trip fewer per call; a revoked key works on this instance for at most that long), and during a
# ledger outage for as long as it lasts (so an outage allowance can be used).
KEY_CACHE_MAX = 10_000
KEY_TRUST_MS = 1_000
# A budget's `clamp` is read again at most this often by an instance (a refused key retrying
# reads it once), and at most this many budgets' are remembered (paths come from keys).
CLAMP_CACHE_MS = 10_000
CLAMP_CACHE_BUDGETS_MAX = 10_000
# Calls' models by their one names (_canonical_model), remembered per process: a name is looked
# up once, not on every call; bounded, as model names come from callers.
MODEL_NAMES_CACHE_MAX = 4_096


@dataclass(frozen=True)
class Caller:
    """An authenticated API key, the role it acts in, and the run it acts for if it named one.

    The role decides whose reservations it makes and may touch: as a sidecar, its key id's; as
    the gateway, the gateway's namespace of that key (GATEWAY_OWNER_PREFIX), which no sidecar
    call can present. None: a read that needs neither (its own budgets)."""

    key: KeyRecord
    run_id: str | None = None
    role: Role | None = None
    user: str | None = None  # the end user it calls for (core/budgets.py check_user)

    @property
    def tag(self) -> str:
        return self.key.budget_id.tag

    @property
    def owner(self) -> str:
        if self.role is Role.GATEWAY:
            return GATEWAY_OWNER_PREFIX + self.key.key_id
        return self.key.key_id

    def ref(self, reservation_id: str) -> ReservationRef:
        return ReservationRef(self.tag, _checked_id(reservation_id), self.owner)

    def run_limit(self) -> RunLimit | None:
        if self.run_id is None or self.key.run_ceiling_micros is None:
            return None
        return RunLimit(self.key.budget_id.run(self.run_id), self.key.run_ceiling_micros)

    def for_user(self, user: object) -> Caller:
        """This caller, calling for `user` (None: no end user)."""
        return self if user is None else replace(self, user=check_user(user))


@dataclass(frozen=True)
class CallSpec:
    """A call to price: an LLM call by model and tokens, or an amount the caller priced.

    `input_tokens` (or the text of `messages`) and `media` (images and audio, priced by the
    model's rules) bound its input; `service_tier` is the tier it asks for: None for the default
    tier, `auto` for the dearest tier the provider may serve it at (core/prices/)."""

    model: str | None = None
    input_tokens: int | None = None
    messages: object = None
    output_tokens_max: int | None = None
    choices: int = 1
    media: Media = NO_MEDIA
    service_tier: str | None = None
    amount_micros: int | None = None
    ttl_ms: int | None = None
    # The genai-prices provider whose prices the model is held at (a gateway call's upstream);
    # None: the first that names it.
    provider: str | None = None
    # The name the call's model is counted by in budgets' models.allow and per_model, before it
    # is given its one name (PriceTable.model_name): a routed call's model as its upstream
    # prices it (core/upstreams.py Routed.priced_model: an Azure deployment's model, a Bedrock
    # id's), which `model` (the name its table's entry has) need not be. None: `model`.
    model_name: str | None = None
    # Whose bill the call is on (a gateway call's, core/formats/base.py Plan.billed); None: a
    # sidecar's, the bill of the provider whose table prices its model, or UNATTRIBUTED for an
    # amount (CeilingService.bill_of).
    bill: Upstream | None = None


@dataclass(frozen=True)
class SettleSpec:
    usage: Usage | None = None
    actual_micros: int | None = None
    upstream: Upstream | None = None  # a gateway call's: its spend counts in that provider's day
    # The genai-prices provider whose table prices the usage; None: `upstream`'s own (a call
    # routed to a named upstream, CEILING_UPSTREAMS, is priced by that upstream's table).
    prices_provider: str | None = None


@dataclass(frozen=True)
class NewKey:
    key_id: str
    api_key: str
    record: KeyRecord


def _monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


def new_key_id() -> str:
    return "key_" + secrets.token_hex(KEY_ID_HEX // 2)


def new_api_key(key_id: str) -> str:
    """A fresh secret of the key `key_id` (one an operator can name: 'key_' and hex)."""
    api_key = f"{API_KEY_PREFIX}{key_id}-{secrets.token_urlsafe(KEY_SECRET_BYTES)}"
    ensure(key_id_of(api_key) == key_id, f"{key_id} is 'key_' and hex, as an operator names ids")
    return api_key


def key_id_of(api_key: str) -> str | None:
    """The key id a secret carries; None for a secret made before secrets carried one."""
    found = _NEW_API_KEY.fullmatch(api_key)
    return found.group(1) if found else None


def hash_api_key(api_key: str) -> str:
    # Keys are 256 random bits, so a plain SHA-256 cannot be brute-forced; no salt is needed.
    return hashlib.sha256(api_key.encode()).hexdigest()


def operator_fingerprint(credential: str) -> str:
    """Who made a correction, as recorded on the reservation: 64 bits of a digest of the
    credential, enough to tell operators apart and never enough to recover a long random token."""
    return "admin:" + hashlib.sha256(credential.encode()).hexdigest()[:16]


def _checked_id(reservation_id: object) -> str:
    if not isinstance(reservation_id, str) or not _RESERVATION_ID.fullmatch(reservation_id):
        raise ReservationNotFound("no such reservation", reservation_id=str(reservation_id))
    return reservation_id


def check_roles(roles: object) -> frozenset[Role]:
    """A key's roles as given to the admin route or the CLI: a non-empty list of known names."""
    known = {r.value: r for r in Role}
    if (not isinstance(roles, list | tuple | frozenset | set) or not roles
            or not all(isinstance(r, str) and r in known for r in roles)):
        raise InvalidRequest(
            f"roles must be a non-empty list of {sorted(known)}", field="roles"
        )
    return frozenset(known[r] for r in roles)


def _fingerprint(model: str, spec: CallSpec, ttl_ms: int, run_id: str | None,
                 user: str | None) -> str:
    words: list[object] = [model, spec.input_tokens, spec.messages, spec.output_tokens_max,
                           spec.choices, spec.amount_micros, ttl_ms, run_id]
    if spec.media is not NO_MEDIA or spec.service_tier is not None or user is not None:
        # Only then: a text-only call's fingerprint stays the one its open records carry, so a
        # replay served by another instance of another version still matches it.
        words += [spec.media, spec.service_tier]
    if user is not None:
        words.append(user)
    return fingerprint(*words)


def check_run_id(run_id: str | None) -> str | None:
    if run_id is not None and not _RUN_ID.fullmatch(run_id):
        raise InvalidRequest("run id must be 1 to 64 of A-Za-z0-9._-", field="run_id")
    return run_id


class CeilingService:
    def __init__(
        self,
        store: ServiceStore,
        prices: PriceTable,
        *,
        lease_ttl_ms: int = RESERVATION_TTL_MS_DEFAULT,
        expire_policy: ExpirePolicy = ExpirePolicy.CHARGE,
        monotonic_ms: Callable[[], int] = _monotonic_ms,
    ) -> None:
        self.store = store
        self.prices = prices
        self.lease_ttl_ms = lease_ttl_ms
        self.expire_policy = expire_policy
        self._models: OrderedDict[str, str] = OrderedDict()
        self._keys: OrderedDict[str, tuple[int, KeyRecord]] = OrderedDict()
        self._monotonic_ms = monotonic_ms
        self.outage = OutageAllowance()
        self._clamps: dict[str, tuple[int, bool]] = {}  # budget path -> (until_ms, clamp)
        # (name counted by, model, provider), in lower case -> the one name sent to the
        # ledger, under the prices version they were looked up in (_canonical_model)
        self._model_names: dict[tuple[str | None, str, str | None], str] = {}
        self._model_names_version = ""

    # -- pricing -------------------------------------------------------------------------

    def worst_case_micros(self, spec: CallSpec) -> tuple[int, str]:
        """The amount to reserve and the model it was priced for ('' if the caller priced it)."""
        if spec.amount_micros is not None:
            if spec.model is not None or spec.output_tokens_max is not None:
                raise InvalidRequest("give either amount_micros or a model call, not both")
            return check_micros(spec.amount_micros, "amount_micros", AMOUNT_MICROS_MAX), ""
        if spec.model is None:
            raise InvalidRequest("give a model call or amount_micros", field="model")
        if spec.output_tokens_max is None:
            raise InvalidRequest(
                "max_output_tokens is required: without an output cap there is no worst case",
                field="max_output_tokens",
            )
        if (spec.input_tokens is None) == (spec.messages is None):
            raise InvalidRequest("give exactly one of input_tokens and messages")
        tokens, media = spec.input_tokens, spec.media
        if tokens is None:
            # Imported here, not above: the formats build a CallSpec (core/formats/base.py), so
            # core.formats imports this module.
            from core.formats.chat import chat_input

            bound = chat_input(spec.messages)
            tokens, media = bound.text_tokens, bound.media
        amount = self.prices.worst_case_micros(
            spec.model, tokens, spec.output_tokens_max, spec.choices, media=media,
            service_tier=spec.service_tier, provider=spec.provider,
        )
        return max(amount, 1), spec.model

    def bill_of(self, model: str) -> Upstream:
        """The bill of a sidecar's call priced as `model` ('' for an amount): the provider's
        whose table prices it (core/ledger.py bill_of_prices), or UNATTRIBUTED for an amount,
        which names no provider."""
        if not model:
            return Upstream.UNATTRIBUTED
        return bill_of_prices(self.prices.provider_of(model))

    def _ttl_ms(self, ttl_ms: int | None) -> int:
        if ttl_ms is None:
            return self.lease_ttl_ms
        ttl_ok = RESERVATION_TTL_MS_MIN <= ttl_ms <= RESERVATION_TTL_MS_MAX
        if type(ttl_ms) is not int or not ttl_ok:
            raise InvalidRequest(
                f"ttl_ms must be an integer from {RESERVATION_TTL_MS_MIN} to "
                f"{RESERVATION_TTL_MS_MAX}",
                field="ttl_ms",
            )
        return ttl_ms

    # -- reserve / settle / release --------------------------------------------------------

    async def reserve(
        self, caller: Caller, spec: CallSpec, idempotency_key: str | None = None
    ) -> Reservation:
        amount, model = self.worst_case_micros(spec)
        ttl_ms = self._ttl_ms(spec.ttl_ms)
        reservation_id = self._reservation_id(caller, idempotency_key)
        # The fingerprint tells a retry from a different call that reused a caller-chosen id. A
        # fresh random id cannot be reused, and a replay of its script sends the same words.
        call_fingerprint = "" if idempotency_key is None else _fingerprint(
            model, spec, ttl_ms, caller.run_id, caller.user)
        gateway = caller.role is Role.GATEWAY
        request = ReserveRequest(
            ref=ReservationRef(caller.tag, reservation_id, caller.owner),
            budget_ids=caller.key.budget_id.lineage,
            amount_micros=amount,
            ttl_ms=ttl_ms,
            fingerprint=call_fingerprint,
            price_version=self.prices.version,
            model=model,
            # A gateway call left held has an outcome nobody but the provider knows: only a
            # 'charge' expiry keeps its possible bill under the ceiling, whatever the policy
            # for sidecar calls (CEILING_EXPIRE_POLICY) is.
            expire_policy=ExpirePolicy.CHARGE if gateway else self.expire_policy,
            run=caller.run_limit(),
            # How long its record answers repeats once resolved (core/limits.py says why): a
            # gateway call's, resolved by the gateway alone under an id minted for it, only a
            # resend of a script; a sidecar's under a minted id, its retry queue's settle or
            # release for minutes; one named by an Idempotency-Key, a replay for the key's day.
            retention_ms=IDEMPOTENCY_WINDOW_MS if idempotency_key is not None
            else RESEND_WINDOW_MS if gateway else REPLAY_WINDOW_MS,
            user=caller.user,
            canonical_model=self._canonical_model(spec, model),
            bill=spec.bill or self.bill_of(model),
        )
        try:
            reservation = await self.store.reserve(request)
        except LedgerUnavailable as exc:
            if exc.reason == "ledger_reset":
                raise  # a wiped ledger is not an outage: the spend it held is gone
            reservation = self.outage.admit(request, exc)
            self._remember_model(reservation_id, model)
            return reservation
        self._remember_model(reservation_id, model)
        if self.outage.learn(request.budget_ids, reservation.legs):  # model rules due
            await self._read_model_rules(request.budget_ids)
        await self.flush_journal()
        return reservation

    async def _read_model_rules(self, budget_ids: tuple[BudgetId, ...]) -> None:
        """Read the path's definitions for the outage allowance's model rules; a path whose
        read fails keeps what was read before (none: its allowance admits no model's call).
        It runs after the call's hold is made, so no failure of it fails the call."""
        try:
            definitions = [await self.store.get_budget(b) for b in budget_ids]
        except CeilingError:
            return
        self.outage.learn_model_rules(budget_ids, definitions)

    def _canonical_model(self, spec: CallSpec, model: str) -> str:
        """The call's model by its one name (PriceTable.model_name), as budgets name models: ''
        for an amount that names no model (`spec.model_name`: a token count names the one it
        counts for); UNLISTED_MODEL for a name that no budget can name (a prices file entry
        with a space in it, a count's model no table prices), so that an allow-list refuses
        it."""
        if not model and not spec.model_name:
            return ""
        if self._model_names_version != self.prices.version:
            # The prices file was read again (or the bundled window moved): names anew.
            self._model_names.clear()
            self._model_names_version = self.prices.version
        # Lower case, as the table looks names up: a caller's case variants are one entry.
        key = (spec.model_name and spec.model_name.lower(), model.lower(), spec.provider)
        found = self._model_names.get(key)
        if found is None:
            name = self.prices.model_name(spec.model_name or model, spec.provider) or (
                self.prices.model_name(model, spec.provider))
            found = name if name is not None and is_model_name(name, limited=False) else (
                UNLISTED_MODEL)
            if len(self._model_names) < MODEL_NAMES_CACHE_MAX:
                self._model_names[key] = found
        return found

    async def flush_journal(self) -> int:
        """Book what this instance admitted during an outage, once the ledger answers."""
        return await self.outage.flush(self.store) if self.outage.journal_size else 0

    def _reservation_id(self, caller: Caller, idempotency_key: str | None) -> str:
        if idempotency_key is None:
            # 128 random bits, as a uuid4 has, without building a UUID object.
            return mint_reservation_id(caller.tag, os.urandom(16).hex())
        # Namespaced by owner: two keys that pick the same idempotency key never collide.
        return mint_reservation_id(caller.tag, key_digest(caller.owner, idempotency_key))

    def _remember_key(self, key_hash: str, record: KeyRecord | None, now_ms: int) -> None:
        if record is None:
            self._keys.pop(key_hash, None)  # revoked: forget it for outages too
            return
        self._keys[key_hash] = (now_ms, record)
        self._keys.move_to_end(key_hash)
        if len(self._keys) > KEY_CACHE_MAX:
            self._keys.popitem(last=False)

    def _remember_model(self, reservation_id: str, model: str) -> None:
        self._models[reservation_id] = model
        if len(self._models) > MODEL_CACHE_MAX:
            self._models.popitem(last=False)

    async def settle(self, caller: Caller, reservation_id: str, spec: SettleSpec) -> Settlement:
        ref = caller.ref(reservation_id)
        if (spec.usage is None) == (spec.actual_micros is None):
            raise InvalidRequest("give either token usage or actual_micros")
        if spec.usage is None:
            actual = check_micros(spec.actual_micros, "actual_micros", AMOUNT_MICROS_MAX, minimum=0)
        else:
            model = self._models.get(reservation_id)
            if model is None:
                view = await self.store.reservation(ref)  # reserved by another instance
                if view is None:
                    raise ReservationNotFound("no such reservation", reservation_id=reservation_id)
                model = view.model
            if not model:
                raise InvalidRequest(
                    "this reservation was made for an amount; settle it with actual_micros",
                    field="actual_micros",
                )
            provider = spec.prices_provider or (
                None if spec.upstream is None else spec.upstream.value)
            actual = self.prices.cost_micros(model, spec.usage, provider)
        journaled = self.outage.settle(ref, actual)
        if journaled is not None:
            await self.flush_journal()
            return journaled
        return await self.store.settle(ref, actual, spec.upstream)

    async def release(self, caller: Caller, reservation_id: str) -> Release:
        ref = caller.ref(reservation_id)
        journaled = self.outage.release(ref)
        if journaled is not None:
            return journaled
        return await self.store.release(ref)

    async def my_budgets(self, caller: Caller, spec: CallSpec | None = None
                         ) -> tuple[LegStatus, ...]:
        """What holds the caller's calls: its path's budgets, its run's, its end user's, and
        every model's per_model limits on its path ('<budget>/model:<name>'); with `spec`, only
        that call's model's, so that another model's spent limit is not read as its room."""
        budget_ids = caller.key.budget_id.lineage
        model = ALL_MODELS if spec is None else self._canonical_model(spec, spec.model or "")
        legs = await self.store.status(budget_ids, caller.run_limit(), caller.user, model)
        self.outage.learn(budget_ids, legs)
        return legs

    async def clamps(self, caller: Caller) -> bool:
        """Whether a budget on the caller's path says its gateway calls are clamped to the room
        left (BudgetDef.clamp). Read on a refusal only, and remembered for CLAMP_CACHE_MS per
        budget: a definition changes rarely, and a refused key may retry many times a second."""
        now_ms = self._monotonic_ms()
        for budget_id in caller.key.budget_id.lineage:
            cached = self._clamps.get(budget_id.path)
            if cached is None or cached[0] <= now_ms:
                definition = await self.store.get_budget(budget_id)
                cached = (now_ms + CLAMP_CACHE_MS, definition is not None and definition.clamp)
                if len(self._clamps) >= CLAMP_CACHE_BUDGETS_MAX:
                    self._clamps.clear()
                self._clamps[budget_id.path] = cached
            if cached[1]:
                return True
        return False

    # -- keys and budgets (admin) -----------------------------------------------------------

    async def authenticate(
        self, api_key: str | None, run_id: str | None = None, role: Role | None = None,
        user: str | None = None,
    ) -> Caller:
        """The caller, acting in `role` (None: a read either role may make) for end user `user`
        (None: none named yet); Unauthorized for no valid key, Forbidden naming the role a valid
        key lacks."""
        if not api_key or not api_key.startswith(API_KEY_PREFIX) or len(api_key) > 128:
            raise Unauthorized("a valid API key is required")
        key_hash = hash_api_key(api_key)
        key_id = key_id_of(api_key)
        known = self._keys.get(key_hash)
        now_ms = self._monotonic_ms()
        if known is not None and now_ms - known[0] < KEY_TRUST_MS:
            record: KeyRecord | None = known[1]
        else:
            try:
                record = await self.store.get_key(key_hash, key_id)
            except LedgerUnavailable as exc:
                # Without an outage allowance the reserve fails closed anyway.
                if known is None or exc.reason == "ledger_reset":
                    raise
                record = known[1]
            else:
                self._remember_key(key_hash, record, now_ms)
        if record is None or not hmac.compare_digest(record.key_hash, key_hash) or (
                key_id is not None and record.key_id != key_id):
            raise Unauthorized("a valid API key is required")
        if role is not None and role not in record.roles:
            raise Forbidden(
                f"this key does not have the '{role}' role these routes need; an operator makes "
                "keys with the roles they need (POST /v1/admin/keys, \"roles\")",
                missing_role=role.value,
            )
        return Caller(record, check_run_id(run_id), role).for_user(user)

    async def create_key(
        self, budget_id: BudgetId, run_ceiling_micros: int | None,
        roles: frozenset[Role] = ROLES_DEFAULT,
    ) -> NewKey:
        roles = check_roles(roles)
        if run_ceiling_micros is not None:
            check_micros(run_ceiling_micros, "run_ceiling_micros", CEILING_MICROS_MAX, minimum=0)
        # A key nothing applies to could never spend: refuse it now, not at its first call.
        defined = [await self.store.get_budget(b) for b in budget_id.lineage]
        if not any(defined):
            raise InvalidRequest(
                f"no budget exists on the path {budget_id}; create one first", field="budget_id"
            )
        key_id = new_key_id()
        api_key = new_api_key(key_id)
        record = KeyRecord(key_id, hash_api_key(api_key), budget_id, run_ceiling_micros, roles)
        await self.store.put_key(record)
        return NewKey(key_id, api_key, record)

    async def rotate_key(self, key_id: str, grace_ms: int) -> str | None:
        """A new secret for the key (to show once), the current one taken for `grace_ms` more
        (core/ledger.py KeyStore.rotate_key); None if there is no such key. This instance
        stops trusting the key's secrets it checked (other instances within KEY_TRUST_MS)."""
        api_key = new_api_key(key_id)
        rotated = await self.store.rotate_key(key_id, hash_api_key(api_key), grace_ms)
        self._forget_key(key_id)
        return api_key if rotated else None

    async def revoke_key(self, key_id: str) -> bool:
        self._forget_key(key_id)
        revoked = await self.store.delete_key(key_id)
        # Again: a check that was in flight while the ledger revoked it may have put it back.
        self._forget_key(key_id)
        return revoked

    def _forget_key(self, key_id: str) -> None:
        for key_hash, (_, record) in list(self._keys.items()):
            if record.key_id == key_id:
                del self._keys[key_hash]

    async def put_budget(self, budget: BudgetDef) -> BudgetDef:
        """Put `budget`, each model it names given its one name (core/budgets.py
        canonical_models; InvalidRequest naming the field of a model no price table knows,
        before anything is written); the definition put."""
        budget = canonical_models(budget, self.prices.model_name)
        await self.store.put_budget(budget)
        return budget

    async def budget(self, budget_id: BudgetId) -> tuple[BudgetDef, tuple[LegStatus, ...]] | None:
        definition = await self.store.get_budget(budget_id)
        if definition is None:
            return None
        legs = await self.store.status((budget_id,))
        return definition, legs

    # -- operators' corrections -------------------------------------------------------------

    async def locate(self, reservation_id: str) -> str:
        """The tag a reservation lives under, from its id alone: its digest prefix and the tag
        map put_budget writes. ReservationNotFound when they find none."""
        reservation_id = _checked_id(reservation_id)
        digest = tag_digest_of(reservation_id)
        if digest is None:
            # Not an id this ledger format mints: `ceiling ledger migrate` counts those a ledger
            # still holds (reservations_without_tag); each ends as its lease and policy say.
            raise ReservationNotFound(
                f"reservation {reservation_id} names no organisation (an id is a tag digest, "
                "'_', then 32 hex digits); `ceiling ledger migrate` counts the ones a ledger "
                "holds as reservations_without_tag, and each expires as its policy says when "
                "its lease ends",
                reservation_id=reservation_id,
            )
        tag = await self.store.tag_of(digest)
        if tag is None:
            raise ReservationNotFound(
                f"reservation {reservation_id}: no budget of its organisation is put",
                reservation_id=reservation_id,
            )
        return tag

    async def inspect(self, reservation_id: str) -> ReservationView:
        tag = await self.locate(reservation_id)
        view = await self.store.inspect(tag, reservation_id)
        if view is None:
            raise ReservationNotFound("no such reservation", reservation_id=reservation_id)
        return view

    async def correct(
        self, reservation_id: str, actual_micros: object, reason: object, corrected_by: str
    ) -> Settlement:
        """An operator's settle of a reservation no key may settle (a gateway call of unknown
        outcome), recorded on it: see Ledger.correct."""
        actual = check_micros(actual_micros, "actual_micros", AMOUNT_MICROS_MAX, minimum=0)
        if (not isinstance(reason, str) or not reason.strip()
                or len(reason) > CORRECTION_REASON_LEN_MAX or not reason.isprintable()):
            raise InvalidRequest(
                f"reason must be 1 to {CORRECTION_REASON_LEN_MAX} printable characters: why the "
                "charge is corrected (the provider's bill, a ticket)", field="reason",
            )
        tag = await self.locate(reservation_id)
        return await self.store.correct(
            tag, reservation_id, actual, Correction(corrected_by, reason)
        )
