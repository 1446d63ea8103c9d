"""Service instances as real processes over real HTTP, in front of real Redis servers."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from infra.redis_server import RedisServer
from infra.service import ServiceProcess

ADMIN_TOKEN = "admin-secret-for-tests"


class Client(httpx.Client):
    """An HTTP client for one instance, with helpers for the admin routes."""

    def admin(self, method: str, path: str, **kwargs: object) -> httpx.Response:
        return self.request(method, path, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                            **kwargs)  # type: ignore[arg-type]

    def budget(self, budget_id: str, ceiling_micros: int, period: str = "total",
               allowance_micros: int = 0) -> None:
        r = self.admin("PUT", f"/v1/admin/budgets/{budget_id}", json={
            "limits": [{"period": period, "ceiling_micros": ceiling_micros}],
            "outage_allowance_micros": allowance_micros})
        assert r.status_code == 200, r.text

    def key(self, budget_id: str, run_ceiling_micros: int | None = None,
            roles: tuple[str, ...] = ("gateway",)) -> dict[str, str]:
        """A new API key's Authorization header; its roles as given (the service's default:
        gateway only)."""
        r = self.admin("POST", "/v1/admin/keys", json={
            "budget_id": budget_id, "run_ceiling_micros": run_ceiling_micros,
            "roles": list(roles)})
        assert r.status_code == 201, r.text
        assert r.json()["roles"] == sorted(roles)
        return {"Authorization": f"Bearer {r.json()['api_key']}"}

    def sidecar_key(self, budget_id: str, run_ceiling_micros: int | None = None
                    ) -> dict[str, str]:
        """A key for the reserve / settle / release routes: the sidecar role only."""
        return self.key(budget_id, run_ceiling_micros, ("sidecar",))


def client_for(service: ServiceProcess) -> Client:
    return Client(base_url=service.url, timeout=10.0)


@pytest.fixture(scope="session")
def service(redis_server: RedisServer) -> Iterator[ServiceProcess]:
    with ServiceProcess({"REDIS_URL": redis_server.url, "CEILING_ADMIN_TOKEN": ADMIN_TOKEN}) as s:
        yield s


@pytest.fixture
def http(service: ServiceProcess) -> Iterator[Client]:
    with client_for(service) as c:
        yield c
