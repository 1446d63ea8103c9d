"""Who may import whom, across the repository's top-level directories and the layers.

    api/          may import core (not core/stores: it gets a store from core/backends.py)
    core/         the domain: imports no api/, no web framework, no HTTP client, and the
                  stores only where they are composed (COMPOSITION): none reads their
                  layout (an export's body is the store's, core/stores/operations.py)
    core/stores/  adapters: may import core and its backends' clients (STORE_CLIENTS)
    lua/          data: read with importlib.resources, never imported as code
    infra/, tests/, bench/, locustfiles/   may import anything; nothing but bench/ imports bench/

Imports are read with `ast`, every one of them (inside functions and TYPE_CHECKING blocks too):
a lazy import is still a dependency.

And the layout docs/gateway.md "Adding a provider API" promises: a provider API is one module
(its format's, or its kind of upstream's and that kind's client, with the parts PROVIDER_PARTS
lists) and its registry lines (REGISTRIES); every other module of core/ and api/ is general and
names no provider in its code, but the units EXEMPT lists by name, each with its reason. Code is
read by `ast`: comments, docstrings and prose strings, which may say whom they are about, are
not code; an identifier or a string value is read by its words (`count_gemini`,
`GeminiUpstream`, `ANTHROPIC_ERROR_TYPES`, `"bedrock"`, `OpenAIThing` each name one); the
upstream clients reach api/upstream.py's client through its public methods only; and every
registered format and kind of upstream is served."""

from __future__ import annotations

import ast
import importlib
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from api.routes.gateway import ROUTES, count_name
from api.upstreams import factory
from core.formats import FORMATS, UNROUTED, WireFormat
from core.upstream_kinds import KINDS
from core.upstream_kinds.kind import UpstreamKind

ROOT = Path(__file__).resolve().parents[1]
# The repository's own Python outside bench/ (build outputs and venvs hold other projects').
SOURCE_DIRS = ("api", "core", "infra", "locustfiles", "tests")
# Web frameworks, servers and HTTP clients: the api layer's, never the domain's.
WEB = frozenset({"starlette", "fastapi", "httpx", "aiohttp", "uvicorn", "mangum"})
# Harnesses, tests and measurements: nothing that ships imports them.
NOT_SHIPPED = frozenset({"infra", "tests", "bench", "locustfiles"})
# The backends' client libraries, which only the adapters in core/stores/ speak (httpx is the
# Upstash REST client there, and the provider's client in api/).
STORE_CLIENTS = frozenset({"redis", "fakeredis", "httpx"})
STORES = "core.stores"
# Where core makes stores: the one module that picks a backend and builds its store and
# catalogue (core/backends.py); every other caller takes the protocols of core/ledger.py.
COMPOSITION = {"core/backends.py": frozenset({STORES})}


def imported_modules(tree: ast.Module) -> set[str]:
    """Every module a file imports, by its full dotted name; `from a import b` counts as both
    `a` and `a.b` (b may be a module)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = "." * node.level + node.module
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names if a.name != "*")
    return found


def imported_roots(tree: ast.Module) -> set[str]:
    return {m.split(".")[0] for m in imported_modules(tree) if not m.startswith(".")}


def sources(*dirs: str) -> Iterator[tuple[str, set[str]]]:
    """(path from the root, modules it imports) for every Python file under `dirs`."""
    for d in dirs:
        for path in sorted((ROOT / d).rglob("*.py")):
            yield (path.relative_to(ROOT).as_posix(),
                   imported_modules(ast.parse(path.read_text(), str(path))))


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_nothing_outside_bench_imports_bench() -> None:
    """bench/ holds entry points that measure; the product, its harnesses (infra/) and its
    tests import none of them, so a benchmark can change without changing what ships."""
    found = []
    paths = [*ROOT.glob("*.py"), *(p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py"))]
    for path in sorted(paths):
        if "bench" in imported_roots(ast.parse(path.read_text(), str(path))):
            found.append(str(path.relative_to(ROOT)))
    assert found == []


def test_the_product_uses_absolute_imports() -> None:
    """So that every rule below sees the module an import names."""
    found = [(path, m) for path, mods in sources("api", "core", "lua") for m in mods
             if m.startswith(".")]
    assert found == []


def test_what_ships_imports_no_harness_test_or_benchmark() -> None:
    found = [(path, m) for path, mods in sources("api", "core", "lua") for m in mods
             if m.split(".")[0] in NOT_SHIPPED]
    assert found == []


def test_core_imports_no_api_and_no_web_framework() -> None:
    """The domain runs the same under the HTTP API, the CLI and a test; it knows no request."""
    found = []
    for path, mods in sources("core"):
        for m in mods:
            root = m.split(".")[0]
            if root == "api" or (root in WEB and not (
                    path.startswith("core/stores/") and root in STORE_CLIENTS)):
                found.append((path, m))
    assert found == []


def test_backend_clients_are_spoken_only_in_core_stores() -> None:
    found = [(path, m) for path, mods in sources("api", "core") for m in mods
             if m.split(".")[0] in STORE_CLIENTS - {"httpx"}
             and not path.startswith("core/stores/")]
    assert found == []


def test_core_imports_the_stores_only_where_it_composes_them() -> None:
    """A caller takes the store protocols it uses (core/ledger.py), so no caller depends on an
    adapter: only the composition points make stores."""
    found = []
    for path, mods in sources("core"):
        if path.startswith("core/stores/"):
            continue
        for m in sorted(mods):
            if not _under(m, STORES) or m == STORES:
                continue
            allowed = COMPOSITION.get(path, frozenset())
            if not any(_under(m, a) for a in allowed):
                found.append((path, m))
    assert found == []


@pytest.mark.parametrize("path", sorted(COMPOSITION))
def test_every_listed_composition_point_exists_and_imports_the_stores(path: str) -> None:
    """The lists above name what is there, not what once was."""
    mods = dict(sources("core"))[path]
    assert any(_under(m, STORES) and m != STORES for m in mods)


def test_api_imports_core_but_not_the_stores() -> None:
    """The API gets its store from core/backends.py, as every other caller does."""
    found = [(path, m) for path, mods in sources("api") for m in mods if _under(m, STORES)]
    assert found == []


def test_lua_is_data() -> None:
    """lua/ holds scripts, read with importlib.resources (core/stores/scripts.py): its one Python
    file makes it a package and imports nothing, and no Python imports it as code."""
    py = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "lua").rglob("*.py"))
    assert py == ["lua/__init__.py"]
    assert dict(sources("lua"))["lua/__init__.py"] == set()
    found = [(path, m) for path, mods in sources(*SOURCE_DIRS, "bench") for m in mods
             if m.split(".")[0] == "lua"]
    assert found == []


# -- the provider API layout ---------------------------------------------------------------
#
# The claim (docs/gateway.md "Adding a provider API"): a provider API is one module (its
# format's, or its kind of upstream's and that kind's client) and its registry lines; nothing
# else in core/ or api/ names a provider in its code, but the units listed below, each with
# the reason it must.

# The words that name a provider, its cloud or its models' families.
PROVIDER_WORDS = frozenset({
    "openai", "openrouter", "gpt", "anthropic", "claude", "gemini", "google", "goog", "vertex",
    "bedrock", "aws", "amazon", "azure", "microsoft"})
# Providers' own spellings that a CamelCase split would cut into words no list holds
# (`OpenAIUpstream` is open/ai/upstream): each is read as one word.
PROVIDER_SPELLINGS = ("OpenAI", "OpenRouter")
# A string constant is read as a value (a comparison's, a key's, a lookup's) when it has no
# whitespace and is at most this long; a longer one or one with spaces is prose: an error
# message may say whose rule refused a call.
STRING_VALUE_CHARS_MAX = 64
# The modules a provider API owns besides its registered format's and kind's own (own_modules),
# each with whose part it is.
PROVIDER_PARTS = {
    "core/formats/openai.py": "what OpenAI's chat and Responses formats share",
    "core/formats/gemini_tokens.py": "the Gemini format's token rules",
    "api/upstreams/cloud_messages.py": "what the bedrock and vertex kinds' clients (the clouds "
                                       "that serve Claude) share",
}
# The registries: the statements that register a provider API are their only mention of one
# (a registry's import of a provider's own module is one of them: REGISTRY_IMPORTS).
REGISTRIES = {
    "core/formats/__init__.py": {"FORMATS": "the formats' registry"},
    "core/formats/names.py": {"Api": "the formats' names: each its path below its provider's "
                                     "base URL"},
    "core/upstream_kinds/__init__.py": {"KINDS": "the kinds' registry"},
}
# The units of general modules that name a provider, by name: a top-level definition (its whole
# body) or one identifier or string (wherever the module uses it). Nothing else in the module is.
EXEMPT = {
    "core/config.py": dict.fromkeys(
        ("anthropic_url", "anthropic_api_key", "CEILING_ANTHROPIC_URL",
         "CEILING_ANTHROPIC_API_KEY", "CEILING_ANTHROPIC_BILL"),
        "the one-upstream shorthand's Anthropic settings (the contract's names)"),
    "api/cli.py": {"anthropic_url": "the shorthand's setting, shown by `ceiling serve`"},
    "core/ledger.py": {"Upstream": "the bill's day counters, one per provider's bill"},
    "core/content.py": {
        **dict.fromkeys(("CLAUDE_IMAGE_TOKENS_MAX", "_CLAUDE_AREA", "CLAUDE_AREA_MODELS",
                         "CLAUDE_OUTPUT_TOKENS_MAX", "_GPT_4O_TILES",
                         "OPENAI_AUDIO_INPUT_TOKENS_PER_S", "GEMINI_AUDIO_INPUT_TOKENS_PER_S",
                         "IMAGE_BOUNDS", "AUDIO_INPUT_TOKENS_PER_S"),
                        "the media and output rules each provider bills by: tables by model, "
                        "named by whose rule each is"),
        "audio_input_tokens_per_s": "Gemini's one audio rate for every model of its family"},
    "core/prices/bundled.py": {
        **dict.fromkeys(("gemini_family", "_GEMINI_VERSION", "_GEMINI_PREVIEW_DATE",
                         "GEMINI_LIMITS_TOKENS", "gemini_limits"),
                        "the Gemini models' versions and limits genai-prices lacks"),
        **dict.fromkeys(("BEDROCK_GEO_PREFIXES", "bedrock_price_key"),
                        "Bedrock's model ids, priced by where they run")},
    "core/prices/__init__.py": {"bedrock_price_key": "re-exported from core/prices/bundled.py"},
    "core/reconcile.py": dict.fromkeys(
        ("OpenAICosts", "AnthropicCosts", "COST_REPORTS"),
        "the cost reports reconciliation reads: each provider's admin API"),
    "api/lambda_handler.py": {"SCHEDULE_SOURCE": "AWS Lambda's scheduled event, the platform "
                                                 "the gateway runs on, not a provider it calls"},
}

# The general modules that import a provider API's own module, which a registry alone does
# (a format named `chat` is no provider's word, so the import is read here, not by its words).
OWN_IMPORTS = {
    "core/service.py": {"core.formats.chat": "the sidecar's reserve takes `messages` in OpenAI's "
                                             "chat shape (the contract's), bounded by that "
                                             "format's walker"},
}


def words(identifier: str) -> set[str]:
    """An identifier's (or a string's) words, lower case: snake_case, CamelCase and any other
    separator split; a provider's own spelling (PROVIDER_SPELLINGS) one word."""
    for spelling in PROVIDER_SPELLINGS:
        identifier = identifier.replace(spelling, spelling.capitalize())
    return {w.lower() for part in re.split(r"[^A-Za-z0-9]+", identifier)
            for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z0-9]+", part)}


def docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstrings' nodes in `tree`: prose, which may say whom it is about."""
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef
                          | ast.AsyncFunctionDef)
            and ast.get_docstring(node, clean=False) is not None
            and isinstance(node.body[0], ast.Expr)}


def identifiers(tree: ast.AST, documented: set[int]) -> Iterator[tuple[int, str]]:
    """Every name the code binds or reads, with its line: names, attributes, definitions,
    parameters, keywords, imports (module paths included); and every string constant that is
    a value (STRING_VALUE_CHARS_MAX), but `documented`'s (docstrings)."""
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Name):
            yield line, node.id
        elif isinstance(node, ast.Attribute):
            yield line, node.attr
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield line, node.name
        elif isinstance(node, ast.arg) or (isinstance(node, ast.keyword) and node.arg):
            yield line, node.arg
        elif isinstance(node, ast.alias):
            yield line, node.asname or node.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield line, node.module
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in documented and len(node.value) <= STRING_VALUE_CHARS_MAX
              and not re.search(r"\s", node.value)):
            yield line, node.value


def kind_modules() -> list[str]:
    return sorted(p.stem for p in (ROOT / "core" / "upstream_kinds").glob("*.py")
                  if p.stem not in ("__init__", "kind"))


def own_modules() -> dict[str, str]:
    """The modules that are one provider API's, by path, with whose: each registered format's
    (its class's module), each declared kind's, the client module of a kind that is its only
    user, and PROVIDER_PARTS."""
    owned = {f"{type(wire).__module__.replace('.', '/')}.py": f"the {wire.name} format"
             for wire in FORMATS.values()}
    owned |= {f"core/upstream_kinds/{module}.py": f"the {module} kind"
              for module in kind_modules()}
    clients = [kind.client for kind in KINDS.values()]
    owned |= {f"api/upstreams/{client}.py": f"the {client} kind's client"
              for client in clients if clients.count(client) == 1}
    return owned | PROVIDER_PARTS


def general_modules() -> list[str]:
    found = sorted(str(p.relative_to(ROOT)) for layer in ("core", "api")
                   for p in (ROOT / layer).rglob("*.py"))
    owned = own_modules()
    return [path for path in found if path not in owned]


def _defines(statement: ast.stmt) -> set[str]:
    """The names a top-level statement defines."""
    if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {statement.name}
    targets = (statement.targets if isinstance(statement, ast.Assign)
               else [statement.target] if isinstance(statement, ast.AnnAssign) else [])
    return {t.id for t in targets if isinstance(t, ast.Name)}


def _imports_own(statement: ast.stmt, owned: set[str]) -> bool:
    """Whether a statement imports only from provider APIs' own modules (a registry's import)."""
    if not isinstance(statement, ast.ImportFrom) or not statement.module:
        return False
    path = statement.module.replace(".", "/")
    return f"{path}.py" in owned or all(f"{path}/{alias.name}.py" in owned
                                        for alias in statement.names)


def provider_names(source: str, exempt: Mapping[str, str] | None = None,
                   registry: bool = False) -> list[str]:
    """The identifiers and string values of `source` that name a provider, with their lines;
    but the top-level definitions and the names `exempt` lists, and in a registry its imports
    of provider APIs' own modules."""
    exempt = exempt or {}
    owned = set(own_modules()) if registry else set()
    found = []
    module = ast.parse(source)
    documented = docstrings(module)
    for statement in module.body:
        if _defines(statement) & set(exempt) or (registry and _imports_own(statement, owned)):
            continue
        found += [f"{line}: {name}" for line, name in identifiers(statement, documented)
                  if name not in exempt
                  and any(words(part) & PROVIDER_WORDS for part in name.split("."))]
    return found


def test_the_words_are_read_from_identifiers_and_values_not_prose() -> None:
    """The reader itself: a provider in an identifier or a string value is found, in a comment,
    a docstring or a message it is not; a provider's own spelling is one word."""
    source = ('"""Gemini\'s."""\n# openai\nx = "the azure upstream refused it"\n'
              "async def count_gemini(): ...\n"
              "GeminiUpstream.send\nfrom core.formats.gemini import GEMINI\n"
              'if getattr(d, "api", "") == "bedrock": pass\nOpenAIThing = OpenRouterThing\n'
              'def f():\n    """Claude\'s."""\n    return {"x-goog-api-key": 1}\n')
    assert sorted(provider_names(source)) == [
        "11: x-goog-api-key", "4: count_gemini", "5: GeminiUpstream", "6: GEMINI",
        "6: core.formats.gemini", "7: bedrock", "8: OpenAIThing", "8: OpenRouterThing"]
    assert words("OpenAIUpstream") == {"openai", "upstream"}


def test_an_exemption_is_its_unit_and_nothing_more() -> None:
    source = ('AZURE_X = "azure"\ndef claude_rule():\n    return "claude"\n'
              'def general(api):\n    return api == "bedrock" or claude_rule()\n')
    assert provider_names(source, {"AZURE_X": "", "claude_rule": ""}) == ["5: bedrock"]


def test_the_general_list_holds_the_modules_the_layout_names() -> None:
    general = set(general_modules())
    assert {"core/gateway.py", "core/gateway_request.py", "core/upstream.py",
            "core/upstreams.py", "core/upstream_kinds/kind.py", "core/formats/base.py",
            "api/routes/gateway.py", "api/auth.py", "api/refusals.py", "api/upstream.py",
            "api/upstreams/base.py", "api/upstreams/__init__.py", "api/upstreams/keyed.py",
            "core/config.py", "core/content.py", "core/ledger.py", "api/cli.py",
            *REGISTRIES} <= general
    listed = [*PROVIDER_PARTS, *REGISTRIES, *EXEMPT]
    assert all((ROOT / path).is_file() for path in listed), "a listed module is gone"
    assert not set(PROVIDER_PARTS) & general


@pytest.mark.parametrize("module", general_modules())
def test_a_general_module_names_no_provider_in_its_code(module: str) -> None:
    exempt = {**REGISTRIES.get(module, {}), **EXEMPT.get(module, {})}
    assert provider_names((ROOT / module).read_text(), exempt,
                          registry=module in REGISTRIES) == []


@pytest.mark.parametrize("module", general_modules())
def test_a_general_module_imports_no_provider_apis_module_but_a_registry(module: str) -> None:
    owned = {path.removesuffix(".py").replace("/", ".") for path in own_modules()}
    imported = imported_modules(ast.parse((ROOT / module).read_text())) & owned
    allowed = owned if module in REGISTRIES else set(OWN_IMPORTS.get(module, {}))
    assert sorted(imported - allowed) == []
    assert sorted(set(OWN_IMPORTS.get(module, {})) - imported) == [], "an unused exemption"


def _exemption_used(module: str, name: str) -> bool:
    """Whether `module` needs its exemption of `name`: the name itself names a provider, or its
    top-level definition does."""
    source = (ROOT / module).read_text()
    if any(hit.split(": ", 1)[1] == name for hit in provider_names(source)):
        return True
    return any(name in _defines(statement) and provider_names(ast.unparse(statement))
               for statement in ast.parse(source).body)


@pytest.mark.parametrize("module", sorted({*REGISTRIES, *EXEMPT}))
def test_every_exemption_is_used(module: str) -> None:
    """An exempt unit that no longer names a provider is dropped from the list."""
    exempt = {**REGISTRIES.get(module, {}), **EXEMPT.get(module, {})}
    assert [name for name in exempt if not _exemption_used(module, name)] == []


def test_a_provider_api_is_one_module_and_its_registry_lines() -> None:
    """Each registered format's class is its own module's, and no other format's class shares
    it; each registered kind is one module's KIND; that module is no general one."""
    classes = {type(wire) for wire in FORMATS.values()}
    modules = [cls.__module__ for cls in classes]
    assert len(set(modules)) == len(classes), modules
    declared = [importlib.import_module(f"core.upstream_kinds.{m}").KIND for m in kind_modules()]
    assert sorted(k.name for k in declared) == sorted(KINDS), "a kind is not one module's"
    general = set(general_modules())
    assert not {f"{m.replace('.', '/')}.py" for m in modules} & general
    assert not {f"core/upstream_kinds/{m}.py" for m in kind_modules()} & general


def _defined_privately(tree: ast.AST) -> set[str]:
    """The `_names` a module defines itself: its functions, classes, module-level names and
    the attributes it assigns (on self or anything else)."""
    defined: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            defined.add(node.attr)
    return {name for name in defined if name.startswith("_")}


def private_reaches(source: str) -> list[str]:
    """The private names of other modules `source` reads: a `._name` attribute it never
    defines, or a `_name` imported from elsewhere (dunders are Python's, not a module's)."""
    tree = ast.parse(source)
    own = _defined_privately(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not (
                node.attr.startswith("__") or node.attr in own):
            found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom):
            found += [f"{node.lineno}: import {alias.name}" for alias in node.names
                      if alias.name.startswith("_") and not alias.name.startswith("__")]
    return found


@pytest.mark.parametrize("module", sorted(
    p.name for p in (ROOT / "api" / "upstreams").glob("*.py")))
def test_an_upstream_client_touches_no_private_member_of_another_module(module: str) -> None:
    assert private_reaches((ROOT / "api" / "upstreams" / module).read_text()) == []


def test_the_private_reach_check_sees_a_reach() -> None:
    """A subclass's own private attribute is its own; its base's is a reach."""
    source = ("from a import _hidden\nclass C(Base):\n    def f(self):\n"
              "        self._mine = 1\n        return self._mine, self._theirs, self.__class__\n")
    assert private_reaches(source) == ["1: import _hidden", "5: ._theirs"]


# -- every registered format and kind is served ----------------------------------------------


def served_paths() -> set[str]:
    return {route.path for route in ROUTES}


@pytest.mark.parametrize("wire", list(FORMATS.values()), ids=lambda wire: wire.name)
def test_every_registered_format_has_its_routes_and_an_upstream_kind(wire: WireFormat) -> None:
    paths = served_paths()
    versions = wire.path_versions or ("",)
    for version in versions:
        route = wire.route if not version else (
            f"/{version}/" + wire.route.removeprefix(f"/{wire.path_versions[0]}/"))
        assert route in paths, f"{wire.api}: no route serves {route}"
    if wire.count_route is not None:
        assert wire.count_route in paths, f"{wire.api}: no route counts at {wire.count_route}"
        assert any(getattr(route.endpoint, "__name__", "") == count_name(wire)
                   for route in ROUTES if route.path == wire.count_route)
    assert any(wire.routed_as in kind.routes for kind in KINDS.values()), (
        f"{wire.api}: no kind of upstream serves its route {wire.routed_as!r}")
    assert not UNROUTED


@pytest.mark.parametrize("module", kind_modules())
def test_every_declared_kind_is_registered(module: str) -> None:
    kind = importlib.import_module(f"core.upstream_kinds.{module}").KIND
    assert isinstance(kind, UpstreamKind)
    assert KINDS.get(kind.name) is kind, f"{module}.KIND is not in core/upstream_kinds KINDS"


@pytest.mark.parametrize("name", list(KINDS))
def test_every_registered_kind_is_served_and_has_a_client(name: str) -> None:
    kind = KINDS[name]
    routes = {wire.routed_as for wire in FORMATS.values()}
    assert kind.routes, f"{name} serves no route"
    assert kind.routes <= routes, f"{name} serves routes no format has: {kind.routes - routes}"
    assert callable(factory(kind.client)), f"api/upstreams/{kind.client}.py has no client"
