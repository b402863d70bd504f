"""`python -m jspec.gpu_e2e`: see jspec/gpu_e2e/__init__.py."""

import sys

from jspec.gpu_e2e.run import main

sys.exit(main())
