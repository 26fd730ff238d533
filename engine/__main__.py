"""`python -m engine` runs the same CLI as `meshcache-engine`."""

import sys

from engine.cli import main

sys.exit(main())
