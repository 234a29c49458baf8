"""Suite-wide settings: the CPU bridge runs in strict mode in every test and every worker process it
launches (``megatron_lowprec.megatron.cpu``), so that code placing a tensor on the CPU where a GPU run
needs it on the device fails here as it would on a GPU."""

import os

from megatron_lowprec.megatron.cpu import STRICT_ENV_VARIABLE

os.environ.setdefault(STRICT_ENV_VARIABLE, "1")
