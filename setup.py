"""Installs the repository's top-level folders model/, evals/, recipes/ and serve/ under the one import
root `dsv41` (dsv41.model, dsv41.evals, dsv41.recipes, dsv41.serve), beside the command line's own package dsv41_cli.
Everything else (metadata, dependencies, package data) is in pyproject.toml; docs/architecture.md,
"Install", says why the folders stay where they are."""

from setuptools import find_packages, setup

FOLDERS = {"model": "dsv41.model", "evals": "dsv41.evals", "recipes": "dsv41.recipes", "serve": "dsv41.serve"}

package_dir = {"dsv41": "dsv41"}
packages = ["dsv41", *find_packages(include=["dsv41_cli", "dsv41_cli.*"])]
for folder, name in FOLDERS.items():
    package_dir[name] = folder
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=package_dir)
