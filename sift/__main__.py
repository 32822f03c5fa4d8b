from sift.env import main

main()
