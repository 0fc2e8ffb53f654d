"""The family registry (``runner_service.families``): a family is one folder, and every folder is a
registered family whose record, tiny build and loop live in it."""

import importlib
import pkgutil

import pytest

import runner_service.families as registry
from runner_service.families import FAMILIES

pytestmark = pytest.mark.unit


def _folders() -> list[str]:
    return sorted(module.name for module in pkgutil.iter_modules(registry.__path__) if module.ispkg)


def test_every_family_folder_is_registered_once():
    records = [importlib.import_module(f"{registry.__name__}.{folder}").FAMILY for folder in _folders()]
    assert sorted(family.name for family in records) == sorted(FAMILIES)
    assert all(FAMILIES[family.name] is family for family in records)


@pytest.mark.parametrize("folder", _folders())
def test_a_familys_tiny_build_and_loop_are_in_its_folder(folder: str):
    family = importlib.import_module(f"{registry.__name__}.{folder}").FAMILY
    assert family.name.replace("-", "_") == folder
    build = getattr(family.build, "func", family.build)  # sd's is the built-in tiny: partial(build_sd, "tiny")
    assert build.__module__ == f"{registry.__name__}.{folder}.tiny"
    if family.loop is not None:
        assert family.loop.__module__ == f"{registry.__name__}.{folder}.loop"
