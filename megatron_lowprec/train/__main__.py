"""``python -m megatron_lowprec.train`` runs ``lowprec-train`` (handy under ``torchrun -m``)."""

import sys

from megatron_lowprec.train.app import main

sys.exit(main())
