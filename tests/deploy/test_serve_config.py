"""deploy/serve_config.yaml is a config Ray Serve accepts, for an app that accepts its args."""

import importlib
from pathlib import Path

import pytest
import yaml
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve.schema import ServeDeploySchema

from rlplane_service.settings import ServiceSettings

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "deploy" / "serve_config.yaml"


def resolve(import_path: str):
    module, _, attr = import_path.partition(":")
    return getattr(importlib.import_module(module), attr)


def check_serve_config(config: dict) -> None:
    """What `serve deploy` checks before it starts anything, plus rlplane's own settings."""
    schema = ServeDeploySchema.model_validate(config)
    assert [a.name for a in schema.applications] == ["rlplane"]
    (app,) = schema.applications
    assert app.route_prefix == "/"
    # Serve hands `args` to the import path's target: it must be a builder that takes them.
    call_user_app_builder_with_args_if_necessary(resolve(app.import_path), app.args)
    # The replica builds ServiceSettings(**args) (extra keys forbidden): a typo fails here.
    ServiceSettings(**app.args)
    assert "api_token" not in app.args, "the token must come from RLPLANE_API_TOKEN, never the config"


def test_serve_config_validates_against_ray_and_rlplane_settings():
    config = yaml.safe_load(CONFIG.read_text())
    check_serve_config(config)
    assert config["http_options"]["port"] == 8000
    assert not [k for k in keys(config) if "token" in k.lower() or "secret" in k.lower()]


def keys(node) -> list[str]:
    """Every mapping key anywhere in a parsed YAML document."""
    if isinstance(node, dict):
        return [str(k) for k in node] + [k for v in node.values() for k in keys(v)]
    if isinstance(node, list):
        return [k for v in node for k in keys(v)]
    return []


def test_check_catches_a_bound_app_given_args_and_a_misspelt_arg():
    config = yaml.safe_load(CONFIG.read_text())
    config["applications"][0]["import_path"] = "rlplane_service.app:app"  # already bound: Serve refuses args
    with pytest.raises(ValueError, match="application builder"):
        check_serve_config(config)
    config = yaml.safe_load(CONFIG.read_text())
    config["applications"][0]["args"]["storage_unit"] = 3
    with pytest.raises(ValueError, match="storage_unit"):
        check_serve_config(config)
