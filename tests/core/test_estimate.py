import pytest

from core.errors import InvalidRequest
from core.estimate import input_tokens_upper_bound


def test_bytes_bound_the_tokens_of_every_message() -> None:
    short = input_tokens_upper_bound([{"role": "user", "content": "hi"}])
    longer = input_tokens_upper_bound([{"role": "user", "content": "hi" * 100}])
    assert 0 < short < longer
    assert longer >= 200


@pytest.mark.parametrize("bad", [[], "hello", [1], None, [{"role": "user"}] * 10_001])
def test_messages_must_be_a_list_of_objects(bad: object) -> None:
    with pytest.raises(InvalidRequest):
        input_tokens_upper_bound(bad)
