"""``python -m fp8kit.demo``."""

import sys

from fp8kit.demo.cli import main

sys.exit(main())
