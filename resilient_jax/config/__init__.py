"""Experiment configuration: the keys every config file starts from, and their validation.

Config files in `configs/` call `default_config()` and change what they need (derivation by
function call, never by inheritance). The config it returns is locked (`ConfigDict.lock()`): a key
it does not define cannot be set, whether by a config file, by `--config.KEY=VALUE` (the launcher
loads files with `config_flags.DEFINE_config_file(..., lock_config=True)`) or by
`update_from_flattened_dict`, and the refusal names the key. `validate()` runs before any work
starts; every problem it finds is a `ConfigError` whose message is one line naming the key, the
value and what is allowed.
"""

from resilient_jax.config.defaults import config_to_dict, default_config, fingerprint
from resilient_jax.config.errors import BadInput, ConfigError
from resilient_jax.config.validation import (
    parse_eval_datasets,
    parse_mixture,
    profile_steps,
    validate,
)

__all__ = [
    "BadInput",
    "ConfigError",
    "config_to_dict",
    "default_config",
    "fingerprint",
    "parse_eval_datasets",
    "parse_mixture",
    "profile_steps",
    "validate",
]
