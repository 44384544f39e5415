"""Test-suite settings.

Compiled fusions (``torch.compile``) cost 10-20 s per process the first time on 2 cores, and
most tests spawn several ranks: outside ``tests/test_fusions*.py`` they run as their eager
references (``TORCHDYNAMO_DISABLE=1``, torch's own switch, inherited by spawned ranks).  The
fusion tests switch compilation back on and check every fusion against its reference, and a
model with all fusions on against one with all off.

The suite is the CPU/gloo suite (what CI runs): on a machine with a GPU it still runs on the CPU
(``MEGALM_FORCE_CPU=1``, read by :mod:`megalm.device`; the tests build CPU inputs and spawn several
gloo ranks on one machine).  GPU paths are checked by ``bench/cuda_check.sh`` on a GPU machine.
"""

import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("MEGALM_FORCE_CPU", "1")
