"""Behaviour of membudget.config: every MEMBUDGET_* variable's accepted forms,
its defaults, its errors (naming the variable and the value) and the docs table."""
import warnings
from pathlib import Path

import pytest

from membudget.config import (
    LOG_CHANNELS,
    POLICIES,
    VARIABLES,
    Config,
    ConfigError,
    Percent,
    describe,
    env_table_markdown,
    format_bytes,
    parse_bytes,
    parse_value,
    physical_memory_bytes,
    resolve_budget,
    resolve_lineage,
)

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


@pytest.mark.parametrize(
    "text, expected",
    [
        ("123456789", 123456789),
        ("1", 1),
        ("512B", 512),
        ("512MB", 512 * 10**6),
        ("2KB", 2000),
        ("3GB", 3 * 10**9),
        ("1TB", 10**12),
        ("512MiB", 512 * MiB),
        ("64KiB", 64 * KiB),
        ("12GiB", 12 * GiB),
        ("2TiB", 2 * TiB),
        ("64K", 64 * KiB),
        ("3M", 3 * MiB),
        ("1.5G", 3 * GiB // 2),
        ("2T", 2 * TiB),
        ("0.5GiB", GiB // 2),
        (".5M", MiB // 2),
        ("0.3K", 307),  # fractions with a unit round down to whole bytes
        ("512 MB", 512 * 10**6),
        ("  12 GiB  ", 12 * GiB),
        ("12gib", 12 * GiB),
        ("12GIB", 12 * GiB),
        ("512mb", 512 * 10**6),
        ("1.5g", 3 * GiB // 2),
        ("7Gi", 7 * GiB),
    ],
)
def test_parse_bytes_accepts(text, expected):
    assert parse_bytes(text, "MEMBUDGET_BUDGET", percent_of="device memory") == expected


@pytest.mark.parametrize("text, value", [("60%", 60), (" 12.5 % ", 12.5), ("100%", 100)])
def test_parse_bytes_accepts_percentages(text, value):
    size = parse_bytes(text, "MEMBUDGET_BUDGET", percent_of="device memory")
    assert isinstance(size, Percent)
    assert float(size.value) == value


BAD_SIZES = ["", "   ", "-5", "-1GiB", "0", "0GiB", "nan", "inf", "-inf", "12 potatoes", "GiB",
             "1.5", "0.5", "0.0001K", "150%", "0%", "100.01%", "1e9", "1,000", "12 GiB extra", "0x10"]


@pytest.mark.parametrize("text", BAD_SIZES)
def test_parse_bytes_rejects_with_variable_and_value(text):
    with pytest.raises(ConfigError) as caught:
        parse_bytes(text, "MEMBUDGET_BUDGET", percent_of="device memory")
    message = str(caught.value)
    assert message.startswith(f"MEMBUDGET_BUDGET={text!r} is not a size")
    assert "12GiB" in message and "60%" in message


def test_garbage_message_is_exactly_as_documented():
    with pytest.raises(ConfigError) as caught:
        Config.from_env({"MEMBUDGET_BUDGET": "12 potatoes"})
    assert str(caught.value) == (
        "MEMBUDGET_BUDGET='12 potatoes' is not a size: use bytes (123456789), units (512MB, 12GiB, 1.5G) "
        "or a percentage of device memory (60%)"
    )


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_percent_is_refused_where_not_meaningful():
    with pytest.raises(ConfigError, match=r"MEMBUDGET_PREFETCH_BYTES='10%'.*percentage is not accepted"):
        Config.from_env({"MEMBUDGET_PREFETCH_BYTES": "10%"})


def test_defaults():
    config = Config.from_env({})
    assert config.budget is None
    assert config.host_budget_bytes == physical_memory_bytes() // 2
    assert config.policy == "delta"
    assert config.actions == "both"
    assert config.records_lineage
    assert config.min_tensor_bytes == MiB
    assert config.prefetch_bytes == 256 * MiB
    assert config.high_watermark == 0.8
    assert config.log == frozenset()
    assert config.budget_bytes(16 * GiB) is None


def test_all_variables_from_env():
    config = Config.from_env(
        {
            "MEMBUDGET_BUDGET": " 12GiB ",
            "MEMBUDGET_HOST_BUDGET": "4G",
            "MEMBUDGET_POLICY": "LRU",
            "MEMBUDGET_ACTIONS": "swap",
            "MEMBUDGET_MIN_TENSOR_BYTES": "64KiB",
            "MEMBUDGET_PREFETCH_BYTES": "0",
            "MEMBUDGET_HIGH_WATERMARK": "0.5",
            "MEMBUDGET_LOG": "evictions, summary,,",
        }
    )
    assert config.budget == "12GiB"
    assert config.budget_bytes(80 * GiB) == 12 * GiB
    assert config.host_budget_bytes == 4 * GiB
    assert config.policy == "lru"
    assert config.actions == "swap"
    assert not config.records_lineage
    assert config.min_tensor_bytes == 64 * KiB
    assert config.prefetch_bytes == 0
    assert config.high_watermark == 0.5
    assert config.log == frozenset({"evictions", "summary"})


def test_zero_is_allowed_for_min_tensor_bytes():
    assert Config.from_env({"MEMBUDGET_MIN_TENSOR_BYTES": "0"}).min_tensor_bytes == 0


def test_budget_percentage_resolves_against_device_capacity():
    config = Config.from_env({"MEMBUDGET_BUDGET": "60%"})
    assert config.budget == "60%"
    assert config.budget_bytes(10 * GiB) == 6 * GiB
    assert resolve_budget("12.5%", 8000) == 1000
    assert resolve_budget("100%", 12345) == 12345
    assert resolve_budget("512MB", None) == 512 * 10**6
    assert resolve_budget(None, 10 * GiB) is None


def test_budget_percentage_needs_a_capacity():
    with pytest.raises(ConfigError, match=r"MEMBUDGET_BUDGET='60%'.*capacity"):
        resolve_budget("60%", None)


def test_host_budget_percentage_is_of_physical_ram():
    config = Config.from_env({"MEMBUDGET_HOST_BUDGET": "25%"})
    assert config.host_budget_bytes == physical_memory_bytes() // 4


@pytest.mark.parametrize(
    "variable, value",
    [
        ("MEMBUDGET_BUDGET", "12 potatoes"),
        ("MEMBUDGET_BUDGET", "0"),
        ("MEMBUDGET_BUDGET", "101%"),
        ("MEMBUDGET_BUDGET", ""),
        ("MEMBUDGET_HOST_BUDGET", "-2G"),
        ("MEMBUDGET_HOST_BUDGET", "0%"),
        ("MEMBUDGET_HOST_BUDGET", "lots"),
        ("MEMBUDGET_POLICY", "fifo"),
        ("MEMBUDGET_POLICY", ""),
        ("MEMBUDGET_ACTIONS", "drop"),
        ("MEMBUDGET_ACTIONS", "drop"),
        ("MEMBUDGET_MIN_TENSOR_BYTES", "-1"),
        ("MEMBUDGET_MIN_TENSOR_BYTES", "1MB of stuff"),
        ("MEMBUDGET_MIN_TENSOR_BYTES", "50%"),
        ("MEMBUDGET_PREFETCH_BYTES", "nan"),
        ("MEMBUDGET_PREFETCH_BYTES", "0.5"),
        ("MEMBUDGET_HIGH_WATERMARK", "0"),
        ("MEMBUDGET_HIGH_WATERMARK", "1.5"),
        ("MEMBUDGET_HIGH_WATERMARK", "-0.2"),
        ("MEMBUDGET_HIGH_WATERMARK", "nan"),
        ("MEMBUDGET_HIGH_WATERMARK", "inf"),
        ("MEMBUDGET_HIGH_WATERMARK", "high"),
        ("MEMBUDGET_LOG", "decisions,verbose"),
        ("MEMBUDGET_LOG", "everything"),
    ],
)
def test_bad_values_name_variable_and_value(variable, value):
    with pytest.raises(ConfigError) as caught:
        Config.from_env({variable: value})
    assert f"{variable}={value!r}" in str(caught.value)


def test_every_policy_is_accepted():
    assert POLICIES == ("delta", "dtr", "msps", "lru", "largest")
    for policy in POLICIES:
        assert Config.from_env({"MEMBUDGET_POLICY": policy.upper()}).policy == policy


def test_unknown_policy_lists_the_accepted_ones():
    with pytest.raises(ConfigError) as caught:
        Config.from_env({"MEMBUDGET_POLICY": "belady"})
    assert "delta, dtr, msps, lru, largest" in str(caught.value)


@pytest.mark.parametrize("actions", ["swap", "recompute", "Both"])
def test_every_action_is_accepted(actions):
    config = Config.from_env({"MEMBUDGET_ACTIONS": actions})
    assert config.actions == actions.lower()
    assert config.records_lineage == (actions.lower() != "swap")


def test_lineage_recorder_is_cxx_on_the_cpu_and_python_on_cuda_unless_told():
    assert Config.from_env({}).lineage == "auto"
    assert resolve_lineage("auto", "cpu") == "cxx" and resolve_lineage("auto", "cuda") == "python"
    assert resolve_lineage("python", "cpu") == "python" and resolve_lineage("cxx", "cuda") == "cxx"
    assert Config.from_env({"MEMBUDGET_LINEAGE": " CXX "}).lineage == "cxx"
    assert Config.from_env({"MEMBUDGET_LINEAGE": "cxx"}, lineage="python").lineage == "python"
    with pytest.raises(ConfigError, match="MEMBUDGET_LINEAGE='rust' is not a lineage recorder: use auto, python or cxx"):
        Config.from_env({"MEMBUDGET_LINEAGE": "rust"})


def test_overrides_win_over_env():
    environ = {"MEMBUDGET_BUDGET": "1GiB", "MEMBUDGET_POLICY": "lru", "MEMBUDGET_LOG": "summary"}
    config = Config.from_env(environ, budget="2GiB", policy="largest", log=["prefetch"], high_watermark=0.9)
    assert config.budget == "2GiB"
    assert config.policy == "largest"
    assert config.log == frozenset({"prefetch"})
    assert config.high_watermark == 0.9


def test_none_overrides_leave_env_in_charge():
    config = Config.from_env({"MEMBUDGET_BUDGET": "1GiB"}, budget=None, policy=None)
    assert config.budget == "1GiB"
    assert config.policy == "delta"


def test_integer_overrides_are_bytes():
    config = Config.from_env({}, budget=3 * GiB, host_budget=GiB, prefetch_bytes=0)
    assert config.budget_bytes(None) == 3 * GiB
    assert config.host_budget_bytes == GiB
    assert config.prefetch_bytes == 0


def test_bad_override_names_the_keyword_and_value():
    with pytest.raises(ConfigError, match=r"^budget='lots' is not a size"):
        Config.from_env({}, budget="lots")
    with pytest.raises(ConfigError, match=r"^budget=0 is not a size"):
        Config.from_env({}, budget=0)


def test_unknown_override_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="bugdet"):
        Config.from_env({}, bugdet="1G")


def test_default_environ_is_os_environ(monkeypatch):
    monkeypatch.setenv("MEMBUDGET_POLICY", "largest")
    assert Config.from_env().policy == "largest"


def test_unknown_variable_warns_with_closest_known_name():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Config.from_env({"MEMBUDGET_BUGDET": "1G", "MEMBUDGET_POLICY": "lru"})
    messages = [str(warning.message) for warning in caught]
    assert any("MEMBUDGET_BUGDET" in m and "did you mean MEMBUDGET_BUDGET?" in m for m in messages), messages


def test_known_and_build_variables_do_not_warn():
    environ = {variable.name: "" for variable in VARIABLES if variable.name == "MEMBUDGET_LOG"}
    environ.update({"MEMBUDGET_BUILD_JOBS": "1", "MEMBUDGET_WITH_CUDA": "0", "OTHER": "x"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Config.from_env(environ)


def test_parse_value_uses_the_given_label():
    assert parse_value("MEMBUDGET_BUDGET", "12GiB") == "12GiB"
    assert parse_value("prefetch_bytes", "1K") == 1024
    with pytest.raises(ConfigError, match=r"^--budget='x' is not a size"):
        parse_value("MEMBUDGET_BUDGET", "x", label="--budget")


def test_directly_built_config_has_the_documented_defaults():
    assert Config() == Config.from_env({})


def test_config_is_frozen():
    config = Config.from_env({})
    with pytest.raises(AttributeError):
        config.policy = "lru"


def test_env_table_mentions_every_variable():
    table = env_table_markdown()
    lines = table.strip().splitlines()
    assert lines[0] == "| Variable | Default | Accepted values | Meaning |"
    names = {"MEMBUDGET_BUDGET", "MEMBUDGET_HOST_BUDGET", "MEMBUDGET_POLICY", "MEMBUDGET_ACTIONS",
             "MEMBUDGET_MIN_TENSOR_BYTES", "MEMBUDGET_PREFETCH_BYTES", "MEMBUDGET_HIGH_WATERMARK",
             "MEMBUDGET_LOG", "MEMBUDGET_EXPANDABLE_SEGMENTS", "MEMBUDGET_RECOMPUTE_AHEAD",
             "MEMBUDGET_LINEAGE", "MEMBUDGET_CHECKPOINT", "MEMBUDGET_COMPILE"}
    assert {variable.name for variable in VARIABLES} == names
    for name in names:
        assert f"`{name}`" in table
    assert len(lines) == 2 + len(names)
    assert all(line.count(" | ") == 3 for line in lines[2:])  # no stray pipes break the table
    for channel in LOG_CHANNELS:
        assert channel in table


def test_module_docstring_documents_every_variable():
    import membudget.config

    for variable in VARIABLES:
        assert f"``{variable.name}``" in membudget.config.__doc__


def test_describe_shows_every_setting():
    config = Config.from_env({"MEMBUDGET_BUDGET": "12GiB", "MEMBUDGET_LOG": "summary,decisions"})
    text = describe(config)
    for variable in VARIABLES:
        assert variable.name in text
    assert "12GiB (12 GiB)" in text
    assert "decisions, summary" in text
    assert "unbounded" in describe(Config.from_env({}))


@pytest.mark.parametrize("count, text", [(0, "0 B"), (512, "512 B"), (MiB, "1 MiB"), (3 * GiB // 2, "1.50 GiB")])
def test_format_bytes(count, text):
    assert format_bytes(count) == text


def test_docs_table_is_the_generated_one():
    docs = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
    assert env_table_markdown() in docs.read_text(), "regenerate the table in docs/configuration.md"


@pytest.mark.parametrize("value, expected", [("1", True), ("on", True), (" YES ", True), ("true", True),
                                             ("0", False), ("off", False), ("No", False), ("false", False)])
def test_expandable_segments_switch(value, expected):
    assert Config.from_env({"MEMBUDGET_EXPANDABLE_SEGMENTS": value}).expandable_segments is expected
    assert Config.from_env({}).expandable_segments is True


def test_expandable_segments_rejects_other_words():
    with pytest.raises(ConfigError, match="MEMBUDGET_EXPANDABLE_SEGMENTS='maybe' is not a switch"):
        Config.from_env({"MEMBUDGET_EXPANDABLE_SEGMENTS": "maybe"})


@pytest.mark.parametrize("value, expected", [("auto", "auto"), (" AUTO ", "auto"), ("1", "on"), ("on", "on"),
                                             (True, "on"), ("0", "off"), ("no", "off")])
def test_recompute_ahead_setting(value, expected):
    assert Config.from_env({}, recompute_ahead=value).recompute_ahead == expected
    assert Config.from_env({}).recompute_ahead == "auto"


def test_recompute_ahead_bad_value_names_variable():
    with pytest.raises(ConfigError, match="MEMBUDGET_RECOMPUTE_AHEAD='sometimes'.*auto, 1 or 0"):
        Config.from_env({"MEMBUDGET_RECOMPUTE_AHEAD": "sometimes"})


def test_recompute_ahead_auto_resolves_per_device():
    from membudget.config import RECOMPUTE_AHEAD_AUTO, resolve_recompute_ahead

    for device, on in RECOMPUTE_AHEAD_AUTO.items():
        assert resolve_recompute_ahead("auto", device) is on
        assert resolve_recompute_ahead("on", device) is True
        assert resolve_recompute_ahead("off", device) is False


def test_recompute_ahead_stays_off_on_cuda_without_record_stream():
    """Note [Recompute ahead needs record_stream]: installed without the C++
    hooks, record_stream is a no-op on CUDA, so no side-stream replay."""
    from membudget.config import resolve_recompute_ahead

    assert resolve_recompute_ahead("auto", "cuda", record_stream_works=False) is False
    with pytest.warns(RuntimeWarning, match="record_stream"):
        assert resolve_recompute_ahead("on", "cuda", record_stream_works=False) is False
    assert resolve_recompute_ahead("on", "cpu", record_stream_works=False) is True
