from dsv41_cli.app import main

if __name__ == "__main__":
    main()
