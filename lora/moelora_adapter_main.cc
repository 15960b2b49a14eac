// moelora-adapter: thin wrapper around RunAdapterCli (lora/cli.h).
#include <iostream>
#include <string>
#include <vector>

#include "lora/cli.h"

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  return moelora::RunAdapterCli(args, std::cout, std::cerr);
}
