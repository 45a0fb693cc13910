import sys

from dsakv.cli.main import main

sys.exit(main())
