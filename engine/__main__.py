"""`python -m engine` runs the same CLI as `meshcache-engine`."""

import sys

from meshcache.engine.cli import main

sys.exit(main())
