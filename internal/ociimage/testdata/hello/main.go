// Command hello is a small binary for ociimage's tests of what does not
// need pdx itself (platforms, base images), which it builds in seconds.
package main

import "fmt"

func main() { fmt.Println("hello") }
