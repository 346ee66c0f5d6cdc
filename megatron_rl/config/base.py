"""What every config module shares: strict models, the error type listing every problem, and
secrets read from the environment variables the config names."""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A config that cannot be used; `errors` holds one line per problem."""

    def __init__(self, source: str, errors: list[str]):
        self.source = source
        self.errors = errors
        super().__init__(f"{source}: invalid config\n" + "\n".join(f"  - {e}" for e in errors))


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def secret_from_env(env_name: str | None, key: str) -> str | None:
    """The value of the environment variable a config key (`key`) names; None when the key is
    unset; an error naming both when the variable is missing or empty."""
    if not env_name:
        return None
    value = os.environ.get(env_name, "")
    if not value:
        raise ConfigError(key, [f"{key} names the environment variable {env_name}, which is not set (or empty)"])
    return value

