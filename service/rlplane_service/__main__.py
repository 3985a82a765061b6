from rlplane_service.cli import main

main()
