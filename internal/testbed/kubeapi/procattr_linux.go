package kubeapi

import "syscall"

// procAttr puts a child in a process group of its own and kills it when the
// test binary dies (a test's timeout panics it) before Stop could.
func procAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}
