"""Values that live on the device: device copies of parameters (``params``), ``ResidentTensor``
(``resident``: data left on the device), ``DeviceParameter`` and ``DeviceTensor`` (``device_tensor``), and what a
device partition of a training forward saves for the backward, as one object (``saved_pack``: ``SavedPack``).
"""
