MESSAGE = "installed from requirements.txt"
