from ndparallel.cli import main

raise SystemExit(main())
