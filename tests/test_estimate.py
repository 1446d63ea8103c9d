import pytest

from core.errors import InputUnbounded, InvalidRequest
from tests.estimate import input_tokens_upper_bound


def test_bytes_bound_the_tokens_of_every_message() -> None:
    short = input_tokens_upper_bound([{"role": "user", "content": "hi"}])
    longer = input_tokens_upper_bound([{"role": "user", "content": "hi" * 100}])
    assert 0 < short < longer
    assert longer >= 200
    # 4 per message, 3 per reply, and the message's JSON: {"role": "user", "content": "hi"}.
    assert short == 4 + 3 + len('{"role": "user", "content": "hi"}')


def test_media_is_not_bounded_by_bytes_here() -> None:
    with pytest.raises(InputUnbounded) as info:
        input_tokens_upper_bound([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}])
    assert info.value.details["field"] == "messages[0].content[0].image_url.url"


@pytest.mark.parametrize("bad", [[], "hello", [1], None, [{"role": "user"}] * 10_001])
def test_messages_must_be_a_list_of_objects(bad: object) -> None:
    with pytest.raises(InvalidRequest):
        input_tokens_upper_bound(bad)
