"""What goes into the ``pyserve-server`` distribution besides ``pyproject.toml``'s metadata.

One distribution holds three trees of this checkout (docs/packaging.md says why):

* ``pyserve/`` — the server, import package ``pyserve``;
* ``hookspecs/src/pyserve_hookspecs/`` — the backend contract, import package ``pyserve_hookspecs``;
* ``examples/model_repository/`` — the bundled example repository, installed as the package data
  ``pyserve/example_repository/`` (what ``pyserve run`` serves without ``--model-repository``).
"""

from setuptools import find_namespace_packages, setup

EXAMPLES = "pyserve.example_repository"
EXAMPLES_DIR = "examples/model_repository"
# Each model folder whose name is an identifier is a (namespace) package to setuptools; listing
# them keeps their files package data of their own folder. Version folders ("1") are not
# identifiers: their files (model.py, .gitkeep) are data of the model folder.
MODELS = [f"{EXAMPLES}.{name}" for name in find_namespace_packages(EXAMPLES_DIR)]
EVERY_FILE = ["**/*", "**/.gitkeep"]  # "*" skips names starting with a dot

setup(
    packages=[*find_namespace_packages(include=["pyserve", "pyserve.*"]), "pyserve_hookspecs", EXAMPLES, *MODELS],
    package_dir={"pyserve_hookspecs": "hookspecs/src/pyserve_hookspecs", EXAMPLES: EXAMPLES_DIR},
    package_data={
        "pyserve": ["py.typed", "protocol/*.proto", "protocol/*.binpb", "frontends/status/assets/*"],
        "pyserve_hookspecs": ["py.typed"],
        EXAMPLES: EVERY_FILE,
        **{model: EVERY_FILE for model in MODELS},
    },
    exclude_package_data={package: ["**/__pycache__/*", "**/*.pyc"] for package in (EXAMPLES, *MODELS)},
)
