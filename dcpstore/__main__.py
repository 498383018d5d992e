import sys

from dcpstore.tools.cli import main

sys.exit(main())
