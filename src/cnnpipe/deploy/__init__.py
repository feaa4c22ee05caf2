"""Using a trained model outside training: TorchScript/ONNX export and `python -m cnnpipe.predict`."""
