import netguard

netguard.install()
