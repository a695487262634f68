"""Parsing experiments.main's flags in-process, shared by the tests of the job's command line.

Import both names (`from tests.flagutil import parse, reset_flags`): pytest uses the imported
autouse fixture in the importing module, so every test there starts from unparsed flags.
"""

import pytest
from absl import flags
from fiddle._src.absl_flags import legacy_flags as fdl_legacy


def parse(*args):
    """Parses command-line flags as `python -m experiments.main ARGS` would."""
    fv = flags.FLAGS
    fv.unparse_flags()
    fv(fdl_legacy.rewrite_fdl_args(["main", *args]))
    return fv


@pytest.fixture(autouse=True)
def reset_flags():
    yield
    flags.FLAGS.unparse_flags()
