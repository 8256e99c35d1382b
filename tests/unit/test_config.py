"""Config dataclasses and command lines: every option described once (field metadata) and shown by
`--help` with its default and choices; environment variables parsed in one place."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from services.gateway.config import GatewayConfig
from shared.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    LOAD_FORMATS,
    POLICIES,
    EngineConfig,
    add_cli_args,
    cli_overrides,
    from_env,
)
from shared.service_main import add_bus_args, add_log_args, bus_auth


def parsers() -> dict[str, argparse.ArgumentParser]:
    from services.detokenizer.__main__ import build_parser as detokenizer
    from services.gateway.__main__ import build_parser as gateway
    from services.scheduler.__main__ import build_parser as scheduler
    from sglbus.serve import build_parser as serve

    return {"serve": serve(), "scheduler": scheduler(), "detokenizer": detokenizer(), "gateway": gateway()}


@pytest.mark.parametrize("cls", [EngineConfig, GatewayConfig])
def test_every_field_has_a_description(cls: type) -> None:
    missing = [f.name for f in fields(cls) if not f.metadata.get("help")]
    assert not missing, f"{cls.__name__} fields without help: {missing}"


def test_fields_with_a_fixed_set_of_values_declare_it() -> None:
    choices = {f.name: f.metadata.get("choices") for f in fields(EngineConfig)}
    assert choices["schedule_policy"] == POLICIES
    assert choices["load_format"] == LOAD_FORMATS
    assert choices["dtype"] == DTYPES
    assert choices["attention_backend"] == ATTENTION_BACKENDS


@pytest.mark.parametrize("name", ["serve", "scheduler", "detokenizer", "gateway"])
def test_every_option_of_every_command_has_help_with_its_default(name: str) -> None:
    parser = parsers()[name]
    options = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    assert options
    undescribed = [a.option_strings[0] for a in options if not a.help or "default:" not in a.help]
    assert not undescribed, f"{name}: options without a description or default: {undescribed}"
    text = parser.format_help()
    for flag in ("--log-level", "--nats-token", "--nats-user", "--nats-password", "--nats-creds"):
        assert flag in text
    if name in ("serve", "scheduler"):
        for values in (POLICIES, LOAD_FORMATS, DTYPES):
            assert "{" + ",".join(values) + "}" in text


def test_serve_help_lists_its_own_options() -> None:
    text = " ".join(parsers()["serve"].format_help().split())  # unwrapped
    for flag in ("--api-key", "--nats-port", "--nats-url", "--host", "--port", "--max-total-tokens"):
        assert flag in text
    assert "default: 4222" in text


def test_a_value_outside_the_choices_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parsers()["scheduler"].parse_args(["--schedule-policy", "shortest"])
    assert exc.value.code == 2
    assert "invalid choice: 'shortest'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="schedule_policy must be one of"):
        EngineConfig(schedule_policy="shortest")


def test_flags_parse_to_typed_overrides() -> None:
    p = argparse.ArgumentParser()
    add_cli_args(p, EngineConfig)
    args = p.parse_args(["--max-total-tokens", "4096", "--disable-radix-cache", "--new-token-ratio", "0.5"])
    assert cli_overrides(args, EngineConfig) == {
        "max_total_tokens": 4096, "disable_radix_cache": True, "new_token_ratio": 0.5,
    }  # fmt: skip
    assert cli_overrides(p.parse_args([]), EngineConfig) == {}  # unset flags leave the environment in charge


def test_a_bad_number_names_its_type(capsys: pytest.CaptureFixture[str]) -> None:
    p = argparse.ArgumentParser()
    add_cli_args(p, EngineConfig)
    with pytest.raises(SystemExit):
        p.parse_args(["--max-total-tokens", "many"])
    assert "invalid int value: 'many'" in capsys.readouterr().err


def test_environment_then_explicit_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLBUS_MAX_TOTAL_TOKENS", "123")
    monkeypatch.setenv("SGLBUS_DISABLE_RADIX_CACHE", "yes")
    monkeypatch.setenv("SGLBUS_MODEL_PATH", "none")
    monkeypatch.setenv("SGLBUS_MAX_QUEUE_WAIT", "2.5")
    cfg = EngineConfig.from_env()
    assert (cfg.max_total_tokens, cfg.disable_radix_cache, cfg.model_path, cfg.max_queue_wait) == (
        123, True, None, 2.5,
    )  # fmt: skip
    assert EngineConfig.from_env(max_total_tokens=7).max_total_tokens == 7
    monkeypatch.setenv("SGLBUS_DISABLE_RADIX_CACHE", "0")
    assert EngineConfig.from_env().disable_radix_cache is False


def test_a_bad_environment_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLBUS_MAX_TOTAL_TOKENS", "lots")
    with pytest.raises(ValueError, match="SGLBUS_MAX_TOTAL_TOKENS='lots'"):
        EngineConfig.from_env()


def test_unknown_options_are_refused() -> None:
    with pytest.raises(TypeError, match="unknown option"):
        from_env(EngineConfig, max_tokens=3)


def test_gateway_api_key_from_the_environment_stays_out_of_repr(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLBUS_API_KEY", "sekrit")
    cfg = from_env(GatewayConfig)
    assert cfg.api_key == "sekrit"
    assert "sekrit" not in repr(cfg)
    monkeypatch.setenv("SGLBUS_API_KEY", "")
    assert from_env(GatewayConfig).api_key is None  # empty: no key


def test_bus_credentials_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLBUS_NATS_TOKEN", "t0k")
    monkeypatch.setenv("SGLBUS_NATS_URL", "nats://bus:4222")
    p = argparse.ArgumentParser()
    add_bus_args(p)
    args = p.parse_args([])
    assert args.nats_url == "nats://bus:4222"
    auth = bus_auth(args)
    assert auth.token == "t0k" and auth.user is None and auth.creds is None
    assert bus_auth(p.parse_args(["--nats-token", "other"])).token == "other"  # the flag wins


def test_work_queue_replicas_from_flag_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGLBUS_NATS_REPLICAS", raising=False)
    p = argparse.ArgumentParser()
    add_bus_args(p)
    assert bus_auth(p.parse_args([])).stream_replicas == 1
    assert bus_auth(p.parse_args(["--nats-replicas", "3"])).stream_replicas == 3
    with pytest.raises(SystemExit):  # JetStream keeps a stream on 1 to 5 nodes
        p.parse_args(["--nats-replicas", "6"])
    monkeypatch.setenv("SGLBUS_NATS_REPLICAS", "3")
    p = argparse.ArgumentParser()
    add_bus_args(p)
    assert bus_auth(p.parse_args([])).stream_replicas == 3


def test_log_level_from_flag_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLBUS_LOG_LEVEL", "WARNING")  # compose and older setups use upper case
    p = argparse.ArgumentParser()
    add_log_args(p)
    assert p.parse_args([]).log_level == "warning"
    assert p.parse_args(["--log-level", "debug"]).log_level == "debug"
    monkeypatch.setenv("SGLBUS_LOG_LEVEL", "loud")
    p = argparse.ArgumentParser()
    add_log_args(p)
    with pytest.raises(SystemExit):
        p.parse_args([])


def test_the_password_file_is_named_for_a_port_other_than_the_default(monkeypatch, tmp_path):
    from sglbus.serve import DEFAULT_NATS_PORT, password_file

    monkeypatch.setenv("SGLBUS_CACHE_DIR", str(tmp_path))
    # what the README's bus clients read
    assert password_file(DEFAULT_NATS_PORT) == str(tmp_path / "nats-bus-api-password")
    # a second server leaves that one alone
    assert password_file(5222) == str(tmp_path / "nats-bus-api-password-5222")


def test_a_server_removes_only_its_own_password_file(monkeypatch, tmp_path):
    from sglbus.serve import _forget_password, _write_password_file, password_file

    monkeypatch.setenv("SGLBUS_CACHE_DIR", str(tmp_path))
    _write_password_file("later-server", 5222)  # another server took the port since
    _forget_password("this-server", 5222)
    assert open(password_file(5222)).read().strip() == "later-server"
    _forget_password("later-server", 5222)
    assert not (tmp_path / "nats-bus-api-password-5222").exists()
    _forget_password("later-server", 5222)  # already gone: nothing to do
