"""The package list, derived from the tree: every folder with an ``__init__.py`` under the four top-level roots
installs as ``kvpool.<root>.<...>``, so a new folder can never be left out of the wheel. Everything else about
the distribution is in pyproject.toml."""

from setuptools import find_packages, setup

# The repository keeps the parts at the top level; they install under the `kvpool` namespace.
ROOTS = ("protocol", "client", "gateway", "daemon")

setup(
    packages=[f"kvpool.{name}" for name in find_packages(include=[f"{root}*" for root in ROOTS])],
    package_dir={f"kvpool.{root}": root for root in ROOTS},
)
