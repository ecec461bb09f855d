"""Unit tests of the router's settings: defaults, environment, flags, and refusals."""

from __future__ import annotations

import pytest

from shardrouter.router.settings import ENV_NAMES, RouterSettings, parse_settings


def test_settings_defaults_env_and_flags() -> None:
    defaults = parse_settings([], env={})
    assert defaults == RouterSettings()
    assert (defaults.listen, defaults.metrics_port, defaults.shard_map, defaults.max_calls) == (
        "127.0.0.1:50051",
        9464,
        "shard-map.yaml",
        1024,
    )
    assert (defaults.dev_mode, defaults.max_message_bytes, defaults.max_metadata_bytes) == (
        False,
        65536,
        16384,
    )
    assert (defaults.shutdown_grace_s, defaults.forward_retries, defaults.reload_interval_s) == (10.0, 2, 1.0)
    env = {"ROUTER_MAX_CALLS": "4", "ROUTER_DEV_MODE": "true", "ROUTER_SHARD_MAP": "/env.yaml"}
    settings = parse_settings(["serve", "--shard-map", "/flag.yaml", "--forward-retries", "0"], env=env)
    assert (settings.max_calls, settings.dev_mode, settings.shard_map, settings.forward_retries) == (
        4,
        True,
        "/flag.yaml",
        0,
    )
    assert "ROUTER_SHARD_TLS_CA" in ENV_NAMES and "ROUTER_RELOAD_INTERVAL_S" in ENV_NAMES
    assert len(ENV_NAMES) == len(set(ENV_NAMES))


@pytest.mark.parametrize(
    ("env", "problem"),
    [
        ({"ROUTER_MAX_CALLS": "0"}, "max_calls must be at least 1"),
        ({"ROUTER_MAX_CALLS": "many"}, "cannot read 'many' as int"),
        ({"ROUTER_DEV_MODE": "perhaps"}, "cannot read 'perhaps' as bool"),
        ({"ROUTER_TLS_CERT": "c.pem"}, "tls_cert and tls_key go together"),
        ({"ROUTER_SHARD_TLS_KEY": "k.pem"}, "shard_tls_cert and shard_tls_key go together"),
        ({"ROUTER_FORWARD_RETRIES": "9"}, "forward_retries must be between 0 and 5"),
        ({"ROUTER_LOG_FORMAT": "xml"}, "log_format must be json or text"),
    ],
)
def test_bad_settings_are_refused(env: dict[str, str], problem: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_settings([], env=env)
    assert problem in str(caught.value)


def test_caller_verification_follows_tls_settings() -> None:
    assert not RouterSettings().verifies_callers
    assert not RouterSettings(tls_cert="c", tls_key="k").verifies_callers
    assert RouterSettings(tls_cert="c", tls_key="k", tls_ca="ca").verifies_callers
    assert RouterSettings(shard_tls_ca="ca").shard_tls_enabled
