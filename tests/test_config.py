import datetime

import pytest

from ring_rewrite import RingDilatedConfig


def test_default_is_exact():
    config = RingDilatedConfig()
    assert config.is_exact
    assert config.branches(100) == ((100, 1),)


def test_lists_become_tuples():
    config = RingDilatedConfig(segment_lengths=[8, 16], dilation_rates=[1, 2])
    assert config.segment_lengths == (8, 16)
    assert config.branches(100) == ((8, 1), (16, 2))


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"segment_lengths": [8]}, "given together"),
        ({"segment_lengths": [8, 16], "dilation_rates": [1]}, "same length"),
        ({"segment_lengths": [], "dilation_rates": []}, "at least one branch"),
        ({"segment_lengths": [8, 12], "dilation_rates": [1, 8]}, r"segment_lengths\[1\] = 12 is not a multiple"),
        ({"segment_lengths": [0], "dilation_rates": [1]}, r"segment_lengths\[0\]"),
        ({"segment_lengths": [8], "dilation_rates": [0]}, r"dilation_rates\[0\]"),
        ({"segment_lengths": [8, 16], "dilation_rates": [2, 4]}, "no rate 1"),
        ({"segment_lengths": [8, 8], "dilation_rates": [1, 1]}, "repeat"),
        ({"segment_lengths": 8, "dilation_rates": 1}, "sequence of ints"),
        ({"segment_lengths": [8.0], "dilation_rates": [1]}, "ints only"),
        ({"sharding": "both"}, "sharding"),
        ({"layout": "striped"}, "layout"),
        ({"compiler": "tvm"}, "compiler"),
        ({"strict": "yes"}, "strict"),
        ({"group": 3}, "group"),
        ({"disable_passes": "attention_modules"}, "disable_passes must be a sequence"),
        ({"disable_passes": [1]}, "disable_passes must be a sequence"),
        ({"disable_passes": 5}, "disable_passes must be a sequence"),
        ({"timeout": 0}, "timeout must be a positive, finite number of seconds"),
        ({"timeout": -1.5}, "timeout must be a positive, finite number of seconds"),
        ({"timeout": "60"}, "timeout must be a positive, finite number of seconds"),
        ({"timeout": True}, "timeout must be a positive, finite number of seconds"),
        ({"segment_lengths": [2**i for i in range(17)], "dilation_rates": [1] * 17}, "at most 16 branches"),
        ({"segment_lengths": [8, 2**63], "dilation_rates": [1, 2]}, r"segment_lengths\[1\] = 9223372036854775808 is larger than an int64"),
        ({"segment_lengths": [8, 2**64], "dilation_rates": [1, 2**64]}, r"segment_lengths\[1\] .* larger than an int64"),
        ({"timeout": float("inf")}, "finite"),
        ({"timeout": float("nan")}, "finite"),
        ({"timeout": 1e300}, "finite"),
    ],
)
def test_invalid_fields_name_the_problem(fields, message):
    with pytest.raises(ValueError, match=message):
        RingDilatedConfig(**fields)


def test_timeout_in_seconds():
    assert RingDilatedConfig().timeout == 300.0
    assert RingDilatedConfig(timeout=datetime.timedelta(minutes=2)).timeout == 120.0
    assert RingDilatedConfig(timeout=5).timeout == 5.0


def test_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        RingDilatedConfig((8,), (1,))  # type: ignore[misc]
    config = RingDilatedConfig()
    with pytest.raises(AttributeError):
        config.strict = True  # type: ignore[misc]


def test_from_options():
    assert RingDilatedConfig.from_options(None) == RingDilatedConfig()
    config = RingDilatedConfig.from_options({"segment_lengths": [8], "dilation_rates": [1]})
    assert config.segment_lengths == (8,)
    with pytest.raises(ValueError, match="unknown ring_dilated option.*segment_length'"):
        RingDilatedConfig.from_options({"segment_length": [8]})
