import pickle

from core.errors import LedgerUnavailable, Unauthorized


def test_errors_keep_their_details_across_processes() -> None:
    error = pickle.loads(pickle.dumps(LedgerUnavailable("x", reason="ledger_reset")))
    assert (error.reason, error.message, error.code) == ("ledger_reset", "x", "ledger_unavailable")
    assert pickle.loads(pickle.dumps(Unauthorized("no", field="a"))).details == {"field": "a"}
