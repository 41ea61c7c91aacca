from gcpatch.cli import main

raise SystemExit(main())
