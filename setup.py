"""Build hook: ship ``dcpstore-dcp-routing.pth`` at the root of site-packages.

Everything else about the distribution is in pyproject.toml. The ``.pth`` line makes
``DCPSTORE_DCP_ROUTING=1`` work with no import in user code (see
``_dcpstore_dcp_routing.py``); it costs one environment read when the variable is unset.
It goes into the wheel for normal installs and into the editable wheel for ``pip install -e``.
"""

from __future__ import annotations

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "dcpstore-dcp-routing.pth"


class BuildPyWithPth(build_py):
    """``build_py`` that also copies the routing ``.pth`` file into the build root."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            # pip install -e: build_lib is thrown away; the editable wheel's root is the
            # "install" command's install_lib (where setuptools puts non-editable files)
            root = self.distribution.get_command_obj("install").install_lib
            self.copy_file(PTH, os.path.join(root, PTH), preserve_mode=False)
        else:
            self.copy_file(PTH, os.path.join(self.build_lib, PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]

    def get_output_mapping(self) -> dict[str, str]:
        mapping = dict(super().get_output_mapping())
        mapping[os.path.join(self.build_lib, PTH)] = PTH
        return mapping


setup(cmdclass={"build_py": BuildPyWithPth})
