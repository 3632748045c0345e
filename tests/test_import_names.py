"""No top-level import name of ours is also installed by another distribution.

Two distributions that install one import name cannot live in one environment: whichever is found first
on ``sys.path`` answers every ``import`` of that name, for both. A dependency that starts to ship a package
under one of our names (as Hugging Face's ``kernels``, which transformers requires, did to a package of
ours once named so) breaks the other's imports; this test turns that into a red test instead of a broken
install.
"""

import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

DISTRIBUTION = "loraplex"
ROOT = Path(__file__).resolve().parents[1]


def our_top_level_packages() -> set[str]:
    """The top-level packages pyproject.toml puts in the distribution (its ``packages.find`` patterns)."""
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    prefixes = [pattern.rstrip("*") for pattern in patterns["include"]]
    return {
        path.parent.name
        for path in ROOT.glob("*/__init__.py")
        if any(path.parent.name == prefix for prefix in prefixes)
    }


def test_the_distribution_is_installed_with_its_packages() -> None:
    ours = our_top_level_packages()
    assert {"app", "engine"} <= ours
    providers = packages_distributions()
    assert all(DISTRIBUTION in providers.get(name, ()) for name in ours), "pip install -e . has not run"


def test_no_other_installed_distribution_provides_our_top_level_packages() -> None:
    providers = packages_distributions()
    shared = {
        name: sorted(set(providers.get(name, ())) - {DISTRIBUTION})
        for name in sorted(our_top_level_packages())
    }
    assert {name: others for name, others in shared.items() if others} == {}, (
        "another installed distribution ships a top-level package under one of our import names; "
        "rename ours (two packages with one import name cannot share an environment)"
    )
