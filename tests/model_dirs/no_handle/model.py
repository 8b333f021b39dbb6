def predict(inputs):
    return None
